"""Signed jobs: what a serving task accepts, and where the secret comes from."""
from __future__ import annotations

import pytest

from autodist.launch import signing
from autodist.launch.signing import JobRejectedError, SecretError

SECRET = b"s3cret-of-the-cluster-0123456789"
ARCHIVE = bytes(range(256)) * 40
NOW = 1_700_000_000.0


def _sealed(secret=SECRET, task="worker:1", now=NOW, job_id="0123abcd"):
    return signing.seal(secret, job_id, task, ARCHIVE, now)


def test_a_sealed_job_opens_for_its_task():
    assert signing.unseal(_sealed(), SECRET, "worker:1", NOW + 5) == ("0123abcd", ARCHIVE)


@pytest.mark.parametrize("message, secret, task, now, reason", [
    (_sealed(secret=b"another-secret-of-32-bytes-long!"), SECRET, "worker:1", NOW,
     "bad signature: the job was not signed with this task's secret"),
    (_sealed(secret=None), SECRET, "worker:1", NOW, "the job is unsigned: the chief has no "
                                                    "secret"),
    (_sealed()[:-1] + b"!", SECRET, "worker:1", NOW, "bad signature"),        # archive changed
    (_sealed().replace(b'"worker:1"', b'"worker:2"'), SECRET, "worker:2", NOW,
     "bad signature"),                                                     # header changed
    (_sealed(), SECRET, "ps:0", NOW, "the job is for task 'worker:1', not this task 'ps:0'"),
    (_sealed(), SECRET, "worker:1", NOW + 601, r"sealed \+601s from this host's clock"),
    (_sealed(), SECRET, "worker:1", NOW - 601, r"sealed -601s from this host's clock"),
    (b"PK\x03\x04 an archive without the header", SECRET, "worker:1", NOW,
     "not a job message"),
    (signing.MAGIC + bytes(32) + b"\xff\xff\xff\xff", SECRET, "worker:1", NOW,
     "malformed job header"),
])
def test_a_job_that_fails_a_check_is_rejected_saying_why(message, secret, task, now, reason):
    with pytest.raises(JobRejectedError, match=reason) as caught:
        signing.unseal(message, secret, task, now)
    assert SECRET.decode() not in str(caught.value)


def _unsigned(header: bytes) -> bytes:
    return signing.MAGIC + bytes(32) + len(header).to_bytes(4, "big") + header + ARCHIVE


@pytest.mark.parametrize("header", [b"[" * 3000, b"{" * 4000, b'{"job_id": ' * 300,
                                    b"\xff" * 100, b'{"task": ' + b"[" * 2000 + b"]" * 2000])
@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "insecure"])
def test_nothing_a_header_holds_escapes_as_another_error(header, secret):
    """Nested or broken JSON is read only after the tag (never with a secret), and is then
    a rejection, not a RecursionError or a parser's error."""
    with pytest.raises(JobRejectedError):
        signing.unseal(_unsigned(header), secret, "worker:1", NOW)


def test_a_rejection_names_the_job_the_message_claimed():
    with pytest.raises(JobRejectedError) as caught:
        signing.unseal(_sealed(secret=None, job_id="feedbeef"), SECRET, "worker:1", NOW)
    assert caught.value.job_id == "feedbeef"


def test_insecure_accepts_unsigned_jobs_but_still_checks_the_task():
    assert signing.unseal(_sealed(secret=None), None, "worker:1", NOW)[1] == ARCHIVE
    assert signing.unseal(_sealed(), None, "worker:1", NOW)[1] == ARCHIVE
    with pytest.raises(JobRejectedError, match="not this task"):
        signing.unseal(_sealed(secret=None), None, "worker:2", NOW)
    forged_header = signing.MAGIC + bytes(32) + b"\x00\x00\x00\x02[]"
    with pytest.raises(JobRejectedError, match="malformed job header"):
        signing.unseal(forged_header, None, "worker:1", NOW)


def test_the_secret_comes_from_a_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.SECRET_ENV, raising=False)
    monkeypatch.delenv(signing.SECRET_FILE_ENV, raising=False)
    assert signing.load_secret() is None
    monkeypatch.setenv(signing.SECRET_ENV, "  from-the-environment-value \n")
    assert signing.load_secret() == b"from-the-environment-value"
    mounted = tmp_path / "secret"
    mounted.write_bytes(SECRET + b"\n")     # a mounted Kubernetes secret, or `echo > file`
    monkeypatch.setenv(signing.SECRET_FILE_ENV, str(mounted))
    assert signing.load_secret() == SECRET
    given = tmp_path / "given"
    given.write_bytes(b"the-one-given-explicitly")
    assert signing.load_secret(str(given)) == b"the-one-given-explicitly"


def test_an_unreadable_or_short_secret_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.SECRET_FILE_ENV, raising=False)
    missing = tmp_path / "nope"
    with pytest.raises(SecretError, match=f"cannot read the secret file '{missing}': No such "
                                          "file"):
        signing.load_secret(str(missing))
    monkeypatch.setenv(signing.SECRET_ENV, "short")
    with pytest.raises(SecretError, match="environment variable AUTODIST_SECRET holds a secret "
                                          "of 5 bytes; use at least 16") as caught:
        signing.load_secret()
    assert "short" not in str(caught.value)

