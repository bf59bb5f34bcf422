"""The fuzz worker process: runs a range of cases of one target, one result line each.

    python -m tests.fuzz.case_worker TARGET SEED START STOP OUT        # run cases
    python -m tests.fuzz.case_worker TARGET SEED --dump INDEX DIR      # write case INDEX's input

OUT receives "ready" after the corpus is built, then one line per finished
case, ``index<TAB>outcome<TAB>seconds<TAB>message length<TAB>detail``, then
"done". Each line is one unbuffered write, so after a crash or a kill the last
line names the last finished case and the next one is the culprit.

Outcomes: "valid" (read as a valid object), "named" (the target's error with a
bounded message), and failures: "other" (another exception), "oversize" (the
named error with a message over the bound), "slow" (over the time bound).
"""
from __future__ import annotations

import os
import pathlib
import resource
import sys
import tempfile
import time
import traceback

# An error message longer than this fails the case (AutodistError caps at 4000).
MAX_MESSAGE_CHARS = 4096
# A case slower than this fails (a reader must not spend seconds on a small input).
SLOW_CASE_S = 5.0


def _limit_resources(native: bool) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # no core files from crashes
    if not native:   # TensorFlow and LightGBM reserve much address space up front
        limit = 3 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _clean(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")[:400]


def _save(value, path: pathlib.Path) -> None:
    if isinstance(value, dict):
        path.mkdir(parents=True, exist_ok=True)
        for key, item in value.items():
            _save(item, path / key)
    elif value is None:
        path.with_name(path.name + ".ABSENT").write_bytes(b"")
    elif isinstance(value, bytes):
        path.write_bytes(value)
    else:
        path.write_text(str(value))


def main(argv: list[str]) -> int:
    from tests.fuzz.mutations import case_rng
    from tests.fuzz.targets import SELF_TESTS, TARGETS

    name, seed = argv[0], int(argv[1])
    target = {**TARGETS, **SELF_TESTS}[name]()
    _limit_resources(target.native)
    # Thousands of small files are written and read: memory-backed if possible.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-", dir=shm) as tmp:
        workdir = pathlib.Path(tmp)
        target.setup(workdir / "setup")
        if argv[2] == "--dump":
            index, out = int(argv[3]), pathlib.Path(argv[4])
            _save(target.case(case_rng(name, seed, index)), out)
            return 0
        start, stop, out = int(argv[2]), int(argv[3]), argv[4]
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(fd, b"ready\n")
        scratch = workdir / "case"
        scratch.mkdir()
        for index in range(start, stop):
            try:
                files = target.case(case_rng(name, seed, index))
            except Exception as e:
                raise RuntimeError(f"the fuzzer failed to make case {index} (a bug in "
                                   "tests/fuzz, not in the reader)") from e
            began = time.perf_counter()
            detail, length = "", 0
            try:
                target.check(files, scratch)
                outcome = "valid"
            except target.error as e:
                message = str(e)
                length = len(message)
                outcome = "named" if length <= MAX_MESSAGE_CHARS else "oversize"
                detail = f"{type(e).__name__}: {message[:300]}"
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                outcome = "other"
                detail = "".join(traceback.format_exception(e)[-3:])
            seconds = time.perf_counter() - began
            if outcome in ("valid", "named") and seconds > SLOW_CASE_S:
                outcome, detail = "slow", f"{seconds:.1f}s; {detail}"
            os.write(fd, f"{index}\t{outcome}\t{seconds:.4f}\t{length}\t"
                         f"{_clean(detail)}\n".encode("utf-8", "backslashreplace"))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        os.write(fd, f"done\t{usage.ru_utime + usage.ru_stime:.1f}\n".encode())
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
