"""Secret files (the cluster secret, the admin token, the tenants file) that group or others may
read, or too short to be secrets, are refused in one line that says how to fix it (exit 2): by
`kvstore serve`, by `kvstore admin`, and by a client reading the secret `kvstore serve` left.
Kills: no mode or length check on an existing file (check_private_file, read_private_file)."""
from __future__ import annotations

import os

import pytest

from kvstore.cli import main as kvstore_main

GOOD = "a-secret-of-sixteen-bytes-or-more"


def write(path, text: str, mode: int):
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        kvstore_main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


SERVE = ["serve", "--node", "a", "--metadata", "memory://secret-files"]


@pytest.fixture(autouse=True)
def no_environment_secrets(monkeypatch, tmp_path):
    for name in ("KVSTORE_SECRET", "KVSTORE_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))

    def started(self):
        raise AssertionError("a daemon was started with this file")

    monkeypatch.setattr("kvstore.daemon.Daemon.start", started)  # a file let through fails the test at once


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_cluster_secret_file_others_may_open_is_refused(tmp_path, capsys, mode):
    path = write(tmp_path / "secret", GOOD, mode)
    err = one_line_error(capsys, SERVE + ["--secret-file", path, "--admin-token-file", str(tmp_path / "tok")])
    assert f"chmod 600 {path}" in err and f"{mode:04o}" in err and "--secret-file" in err


def test_a_short_cluster_secret_is_refused(tmp_path, capsys):
    path = write(tmp_path / "secret", "short-secret", 0o600)
    err = one_line_error(capsys, SERVE + ["--secret-file", path, "--admin-token-file", str(tmp_path / "tok")])
    assert "12 bytes, fewer than 16" in err and "regenerate" in err


def test_an_admin_token_file_others_may_read_is_refused_by_the_daemon_and_the_cli(tmp_path, capsys):
    secret = write(tmp_path / "secret", GOOD, 0o600)
    token = write(tmp_path / "token", GOOD, 0o644)
    err = one_line_error(capsys, SERVE + ["--secret-file", secret, "--admin-token-file", token])
    assert "--admin-token-file" in err and f"chmod 600 {token}" in err
    assert kvstore_main(["admin", "--metadata", "etcd://127.0.0.1:1", "--admin-token-file", token, "nodes"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"chmod 600 {token}" in err, err
    short = write(tmp_path / "short", "tiny", 0o600)
    assert "fewer than 16" in one_line_error(capsys, SERVE + ["--secret-file", secret, "--admin-token-file", short])


@pytest.mark.parametrize("content, mode, says", [
    (f"acme {GOOD}\n", 0o644, "chmod 600"),
    ("acme short\n", 0o600, "line 1: tenant 'acme' needs a secret of at least 16 bytes"),
    (f"# tenants\n\nacme {GOOD}\nbad/name {GOOD}x\n", 0o600, "line 4: the tenant name must be"),
    (f"acme {GOOD}\nacme {GOOD}x\n", 0o600, "line 2: tenant 'acme' is listed twice"),
    (f"acme {GOOD}\nbeta {GOOD}\n", 0o600, "two tenants share a secret"),
    ("acme\n", 0o600, "line 1: tenant 'acme' needs a secret"),
], ids=["loose", "short", "bad-name", "twice", "shared", "no-secret"])
def test_a_bad_tenants_file_is_refused_in_one_line(tmp_path, capsys, content, mode, says):
    secret = write(tmp_path / "secret", GOOD, 0o600)
    tenants = write(tmp_path / "tenants", content, mode)
    err = one_line_error(capsys, SERVE + ["--secret-file", secret, "--admin-token-file", str(tmp_path / "tok"),
                                          "--tenants", tenants])
    assert "--tenants" in err and says in err, err


def test_tenants_need_a_cluster_secret(tmp_path, capsys):
    tenants = write(tmp_path / "tenants", f"acme {GOOD}\n", 0o600)
    err = one_line_error(capsys, SERVE + ["--insecure", "--tenants", tenants])
    assert "--tenants needs a cluster secret" in err


def test_a_good_tenants_file_is_read(tmp_path):
    from kvstore.access import load_tenants

    path = write(tmp_path / "tenants", f"# who\nacme {GOOD}\n  beta.team-2   {GOOD}x  \n", 0o600)
    assert load_tenants(path) == {"acme": GOOD.encode(), "beta.team-2": (GOOD + "x").encode()}


def test_a_client_refuses_the_cluster_secret_file_when_others_may_read_it(tmp_path):
    """The file `kvstore serve` leaves in ~/.kvstore, which a client takes when given no secret."""
    from kvstore.access import client_secret, secret_path
    from kvstore.errors import InsecureFile

    path = secret_path("c1")
    os.makedirs(os.path.dirname(path))
    write(tmp_path / ".kvstore" / "c1.secret", GOOD, 0o644)
    with pytest.raises(InsecureFile, match="chmod 600"):
        client_secret("c1", None)
    os.chmod(path, 0o600)
    assert client_secret("c1", None)[0] == GOOD


def test_a_secret_file_created_by_two_processes_at_once_is_read_whole_by_both(tmp_path, monkeypatch):
    """Two daemons of one cluster starting together both make its admin token file (the fleet
    benchmark starts a cluster's daemons at once): the one that loses must read the winner's
    whole token. The loser here runs while the winner draws its token, the moment the file
    used to exist empty. Kills: creating the file in place and writing the token after
    (the loser read 0 bytes and refused to start: "holds 0 bytes, fewer than 16")."""
    import secrets

    from kvstore.access import ensure_private_file

    path = str(tmp_path / "keys" / "cluster.admin-token")
    draw = secrets.token_urlsafe
    other: list[tuple[str, bool]] = []  # what the process that started meanwhile got

    def draw_while_another_starts(n: int) -> str:
        if not other:
            other.append(("", False))  # once: its own draw is the plain one
            other[0] = ensure_private_file(path, "an admin token", "", announce=None)
        return draw(n)

    monkeypatch.setattr(secrets, "token_urlsafe", draw_while_another_starts)
    value, created = ensure_private_file(path, "an admin token", "", announce=None)
    assert other[0] == (value, True) and not created  # the other process made it; this one read it whole
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert os.listdir(tmp_path / "keys") == ["cluster.admin-token"]  # no staging file left
