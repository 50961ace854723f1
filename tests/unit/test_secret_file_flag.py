"""``meshrun launch --secret-file PATH`` is ``MESHRUN_JOB_SECRET_FILE=PATH`` for every launcher
behind it: the one-node and multi-node launch (``resolve``) and the hostfile launch (the key it
sends each host) all read that file's key; a file others can read, or a second secret in the
environment, is refused naming the flag. (The real launch: tests/e2e/test_launch_secret_file.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.launch.hostfile.remote import job_secret
from meshrun.launch.trust.secret import SECRET_FILE_ENV, resolve, use_secret_file
from meshrun.runtime.secret import SECRET_ENV, SecretError

pytestmark = pytest.mark.timeout(30)
KEY = "5a" * 32


def _file(tmp: Path, mode: int = 0o600) -> Path:
    path = tmp / "key"
    path.write_text(KEY + "\n")
    path.chmod(mode)
    return path


def test_every_launcher_reads_the_files_key(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    got = use_secret_file(str(_file(tmp_path)), environ)
    assert got.key == KEY.encode() and environ == {SECRET_FILE_ENV: str(tmp_path / "key")}
    run_dir = tmp_path / "run"
    assert resolve(str(run_dir), environ, create=True).key == KEY.encode()  # one node, host
    assert resolve(str(run_dir), environ, create=False).key == KEY.encode()  # a joining node
    assert not (run_dir / "job.secret").exists()
    assert job_secret(environ) == KEY  # what --hostfile sends every host


def test_an_unsafe_or_contradicted_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    path = _file(tmp_path, 0o640)
    with pytest.raises(SecretError, match=f"--secret-file {path} has mode 640"):
        use_secret_file(str(path), {})
    path.chmod(0o600)
    with pytest.raises(SecretError, match=f"--secret-file {path} and {SECRET_ENV} are both"):
        use_secret_file(str(path), {SECRET_ENV: "b" * 64})
    other = {SECRET_FILE_ENV: str(tmp_path / "elsewhere")}
    with pytest.raises(SecretError, match="name different files"):
        use_secret_file(str(path), other)
    same = {SECRET_FILE_ENV: str(path)}
    assert use_secret_file(str(path), same).key == KEY.encode()  # the same file twice is fine
    with pytest.raises(SecretError, match="cannot read the job secret --secret-file"):
        use_secret_file(str(tmp_path / "missing"), {})
