"""The documentation: the site builds without a warning, and what the pages show is true.

`mkdocs build --strict` (mkdocs.yml) fails on any warning: a broken link between
pages or to a heading, a link out of docs/ that the site does not publish, a
docstring the API reference cannot render. The other tests check what a build
cannot: the README's links and length, the benchmark table against its results
file, the Kubernetes manifests against the command line and TF_CONFIG readers, and
the one version source.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300


def _missing_docs_tools() -> list[str]:
    return [name for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")
            if importlib.util.find_spec(name) is None]


def test_the_site_builds_strictly(tmp_path):
    missing = _missing_docs_tools()
    if missing:
        pytest.skip(f"the documentation tools are not installed ({', '.join(missing)}): "
                    f"pip install -e '.[docs]' (scripts/install.sh installs them)")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-8000:]}"
    assert (site / "index.html").is_file()
    for page in ("reference/api", "reference/ir", "reference/runtime", "reference/policies"):
        html = (site / page / "index.html").read_text(encoding="utf-8")
        assert "doc-heading" in html, f"{page}: no API entries rendered"
    # Links out of docs/ to published files reach them in the site.
    assert (site / "benchmarks" / "results" / "emulated.png").is_file()
    assert (site / "examples" / "01_optimize_your_model.ipynb").is_file()


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if "://" in link:
            continue
        path = link.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README links to {link}, which does not exist"


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def test_the_benchmark_table_is_the_results_summary():
    """docs/benchmarks.md's table between the bench:summary markers is emulated.md's."""
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    table = _between(page, "<!-- bench:summary:start -->", "<!-- bench:summary:end -->")
    results = (ROOT / "benchmarks" / "results" / "emulated.md").read_text(encoding="utf-8")
    assert table == _between(results, "## Summary", "## Every"), (
        "copy the Summary table of benchmarks/results/emulated.md between the markers")


def _manifests() -> list[list[dict]]:
    """The YAML blocks of docs/multihost.md, each a list of documents."""
    text = (DOCS / "multihost.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    return [[d for d in yaml.safe_load_all(block) if d] for block in blocks]


def _containers(template: dict) -> list[dict]:
    return template["spec"]["containers"]


def _check_command(command: list[str], chief: bool) -> None:
    from autodist.cli import build_parser

    if chief:
        assert command[0] == "python", command
        return
    assert command[:2] == ["autodist", "serve"], command
    args = build_parser().parse_args(command[1:])
    assert args.tf_config and not args.cluster and not args.insecure


def _check_secret(container: dict, volumes: list[dict]) -> None:
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secret_file = pathlib.PurePosixPath(env["AUTODIST_SECRET_FILE"])
    volume = next(v for v in volumes if "secret" in v)
    assert mounts[volume["name"]] == str(secret_file.parent)
    assert volume["secret"]["secretName"] == "autodist-secret"


def test_the_tfjob_manifest_serves_every_task_but_the_chief():
    from autodist.launch.tf_config import task_from_tf_config

    (tfjob,), = [docs for docs in _manifests() if docs[0]["kind"] == "TFJob"]
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    # The TF_CONFIG the operator writes: one job per replica type, port 2222.
    name = tfjob["metadata"]["name"]
    cluster = {kind.lower(): [f"{name}-{kind.lower()}-{i}:2222" for i in range(spec["replicas"])]
               for kind, spec in replicas.items()}
    for kind, spec in replicas.items():
        (container,) = _containers(spec["template"])
        assert container["name"] == "tensorflow"  # the container the operator configures
        assert container["ports"][0]["containerPort"] == 2222
        _check_secret(container, spec["template"]["spec"]["volumes"])
        for index in range(spec["replicas"]):
            tf_config = {"cluster": cluster, "task": {"type": kind.lower(), "index": index}}
            resource_spec, own = task_from_tf_config(tf_config, gpus_per_worker=0)
            is_chief = own == resource_spec.task_of(resource_spec.chief_index)
            assert is_chief == (kind == "Chief")
            _check_command(container["command"], is_chief)


def test_the_plain_manifests_name_their_tasks_and_serve_every_task_but_the_chief():
    from autodist.launch.tf_config import task_from_tf_config

    (documents,) = [docs for docs in _manifests() if any(d["kind"] == "Pod" for d in docs)]
    services = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Service"}
    pods = [d for d in documents if d["kind"] == "Pod"]
    chiefs, clusters = 0, set()
    for pod in pods:
        (container,) = _containers(pod)
        env = {e["name"]: e.get("value") for e in container["env"]}
        tf_config = json.loads(env["TF_CONFIG"])
        clusters.add(json.dumps(tf_config["cluster"], sort_keys=True))
        resource_spec, own = task_from_tf_config(tf_config, gpus_per_worker=0)
        is_chief = own == resource_spec.task_of(resource_spec.chief_index)
        chiefs += is_chief
        _check_command(container["command"], is_chief)
        _check_secret(container, pod["spec"]["volumes"])
        # The pod's own address is a headless service selecting it, on the pod's port.
        kind, index = tf_config["task"]["type"], tf_config["task"]["index"]
        host, port = tf_config["cluster"][kind][index].rsplit(":", 1)
        service = services[host]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert int(port) == service["spec"]["ports"][0]["port"] == \
            container["ports"][0]["containerPort"]
    assert chiefs == 1 and len(clusters) == 1
    assert len(pods) == sum(len(v) for v in json.loads(clusters.pop()).values())


def test_the_network_policy_admits_the_job_pods():
    (policy,), = [docs for docs in _manifests() if docs[0]["kind"] == "NetworkPolicy"]
    labels = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == labels
    for docs in _manifests():
        for document in docs:
            if document["kind"] == "Pod":
                assert labels.items() <= document["metadata"]["labels"].items()
            if document["kind"] == "TFJob":
                for spec in document["spec"]["tfReplicaSpecs"].values():
                    assert labels.items() <= spec["template"]["metadata"]["labels"].items()


def test_setup_reads_the_version_from_the_package():
    import autodist

    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == autodist.__version__
    assert "version=read_version()" in (ROOT / "setup.py").read_text(encoding="utf-8")
