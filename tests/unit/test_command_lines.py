"""The command lines a new user meets first: one line and exit code 2 for every bad value, --version
and defaults in --help everywhere, renamed flags still accepted, `kvstore serve --config`."""
from __future__ import annotations

import os
import time

import pytest

from kvstore.cli import main as kvstore_main
from kvstore.cli import parse

VERSION = __import__("importlib.metadata").metadata.version("kvstore")


def one_line_error(capsys, call) -> str:
    """Run `call`, expecting exit 2 and exactly one line on stderr (no traceback); return it."""
    with pytest.raises(SystemExit) as done:
        call()
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err


# --- bad values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag, accepted", [
    (["serve", "--node", "a", "--dram", "16XB"], "--dram", "GiB"),
    (["serve", "--node", "a", "--disk-size", "lots"], "--disk-size", "GiB"),
    (["serve", "--node", "a", "--disk", "-1"], "--disk", "GiB"),
    (["serve", "--node", "a", "--high-watermark", "1.5"], "--high-watermark", "(0, 1]"),
    (["serve", "--node", "a", "--replicas", "0"], "--replicas", "[1, 16]"),
    (["serve", "--node", "a", "--replicas", "1000000"], "--replicas", "[1, 16]"),
    (["serve", "--node", "a", "--timeout", "1e309"], "--timeout", "(0, 3600]"),
    (["serve", "--node", "a", "--timeout", "nan"], "--timeout", "(0, 3600]"),
    (["serve", "--node", "a", "--insecure", "--dram", "100TiB"], "--dram", "memory"),
    (["admin", "--timeout", "inf", "status"], "--timeout", "(0, 3600]"),
    (["serve", "--node", "a", "--metrics-port", "70000"], "--metrics-port", "[0, 65535]"),
    (["serve", "--node", "a", "--listen", "7000"], "--listen", "HOST:PORT"),
    (["serve", "--node", "a", "--timeout", "0"], "--timeout", "(0, 3600]"),
    (["serve", "--node", "a b"], "--node", "must be"),
    (["serve", "--node", "a", "--log-level", "loud"], "--log-level", "debug"),
    (["serve", "--node", "a", "--tls-cert", "/nonexistent.pem"], "--tls-cert", "readable file"),
    (["serve", "--node", "a", "--metadata", "etc://127.0.0.1:2379"], "--metadata", "etcd://host:port"),
    (["admin", "blocks", "--fingerprint", "zz"], "--fingerprint", "32 lowercase hex"),
    (["admin", "policy", "n", "--high", "2"], "--high", "(0, 1]"),
    (["admin", "--timeout", "-1", "status"], "--timeout", "(0, 3600]"),
])
def test_a_bad_value_is_one_line_naming_the_flag_and_what_it_takes(capsys, argv, flag, accepted):
    """Kills: `--dram 16XB` (any unparsable size) ending in a ValueError traceback from parse_size
    inside run_serve; a bad value reaching the daemon and failing its start with exit 1; argparse's
    multi-line usage block before the error; `--timeout 1e309` (infinity) accepted and failing in
    the engine with an OverflowError traceback; `--replicas 1000000` accepted; `--dram` larger
    than the machine accepted (the daemon filled pages until the OOM killer took it)."""
    err = one_line_error(capsys, lambda: kvstore_main(argv))
    assert flag in err and accepted in err


def test_low_above_high_watermark_is_refused_before_start(capsys):
    err = one_line_error(capsys, lambda: kvstore_main(["serve", "--node", "a", "--insecure", "--high-watermark",
                                                       "0.5", "--low-watermark", "0.6"]))
    assert "--low-watermark" in err and "--high-watermark" in err


@pytest.mark.parametrize("model, says", [
    ('{"model_id": "m"}', "missing dtype"),
    ('{"model_id": "m", "dtype": "f", "block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 1, '
     '"colour": 1}', "unknown colour"),
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
])
def test_admin_query_with_an_incomplete_model_is_one_line(capsys, tmp_path, monkeypatch, model, says):
    """Kills: `kvstore admin query --model '{"model_id": ...}'` missing fields ending in a TypeError
    traceback from ModelFingerprint(**json); the check running only after etcd was reached (here
    there is none: the input is refused first)."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[1, 2, 3]")
    monkeypatch.setenv("KVSTORE_METADATA", "etcd://127.0.0.1:9")
    started = time.monotonic()
    assert kvstore_main(["admin", "query", "--tokens", str(tokens), "--model", model]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--model" in err and says in err, err
    assert time.monotonic() - started < 2


def test_admin_query_tokens_file_missing_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("KVSTORE_METADATA", "etcd://127.0.0.1:9")
    model = '{"model_id": "m", "dtype": "float32", "block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 1}'
    assert kvstore_main(["admin", "query", "--tokens", "/nonexistent.json", "--model", model]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--tokens" in err and "/nonexistent.json" in err


# --- the metadata URL --------------------------------------------------------------------------------

def test_admin_without_metadata_is_an_error_saying_what_to_set(capsys, monkeypatch):
    """Kills: `kvstore admin status` with no KVSTORE_METADATA and no --metadata reading an empty
    memory://default and printing an empty cluster with exit 0."""
    monkeypatch.delenv("KVSTORE_METADATA", raising=False)
    assert kvstore_main(["admin", "status"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "KVSTORE_METADATA" in err and "--metadata" in err


def test_admin_refuses_a_memory_index(capsys, monkeypatch):
    """Kills: `--metadata memory://x` (an index private to the admin process) answering 'no nodes'."""
    monkeypatch.delenv("KVSTORE_METADATA", raising=False)
    assert kvstore_main(["admin", "--metadata", "memory://default", "nodes"]) == 2
    assert "etcd://" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["admin", "--metadata", "etc://127.0.0.1:2379", "status"],
                                  ["admin", "status", "--metadata", "etc://127.0.0.1:2379"]])
def test_admin_misspelled_scheme_fails_at_once(capsys, argv):
    """Kills: the admin mirror waiting its 10 s timeout, then 'cannot reach the metadata service'
    (exit 5), on a URL the parser refuses at once."""
    started = time.monotonic()
    assert kvstore_main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown metadata URL 'etc://127.0.0.1:2379'" in err and time.monotonic() - started < 2


def test_conductor_misspelled_scheme_fails_at_once(capsys):
    from conductor.cli import main

    started = time.monotonic()
    err = one_line_error(capsys, lambda: main(["serve", "--metadata", "etc://127.0.0.1:2379", "--fingerprint", "{}"]))
    assert "unknown metadata URL" in err and time.monotonic() - started < 2


def test_conductor_gateway_with_its_metadata_unreachable_is_one_line_and_exit_5(capsys):
    """Kills: the gateway's index mirror failing to start as a 44-line traceback and exit 1 (the
    router service already said it in one line, exit 5), and the mirror's own retry warnings
    before that line."""
    from conductor.cli import main

    from kvstore_testing.ports import free_port

    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as done:
        main(["serve", "--decode", f"http://{dead}", "--metadata", f"etcd://{dead}", "--listen", "127.0.0.1:0"])
    assert done.value.code == 5
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot reach the metadata service" in err, err


def test_conductor_bad_fingerprint_is_one_line(capsys):
    """Kills: a JSONDecodeError/TypeError traceback from ModelFingerprint(**json.loads(...))."""
    from conductor.cli import main

    err = one_line_error(capsys, lambda: main(["serve", "--metadata", "memory://x", "--fingerprint", '{"model_id": 1}']))
    assert "--fingerprint" in err


def test_conductor_bad_gateway_setting_is_one_line(capsys):
    from conductor.cli import main

    err = one_line_error(capsys, lambda: main(["serve", "--decode", "ftp://engine"]))
    assert "http://" in err


def test_conductor_unknown_policy_is_one_line(capsys):
    """Kills: the policy name checked only when the gateway builds its router (a traceback, exit 1)."""
    from conductor.cli import main

    err = one_line_error(capsys, lambda: main(["serve", "--decode", "http://127.0.0.1:9", "--policy", "cache"]))
    assert "--policy" in err and "cache_global" in err


def test_conductor_help_shows_each_default_once_and_readably(capsys):
    """Kills: help text given GatewayConfig's defaults blindly ('<dataclasses._MISSING_TYPE object ...>'
    for required fields, '(default: ...) (default: 128)' where the help already names one)."""
    from conductor.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "MISSING" not in out
    assert "block size) (default:" not in out and "(default: default) (default:" not in out


# --- admin: global flags before or after the subcommand --------------------------------------------

@pytest.mark.parametrize("argv", [
    ["admin", "--json", "--metadata", "etcd://h:1", "--cluster", "c", "--timeout", "3", "--admin-token-file", "t",
     "status"],
    ["admin", "status", "--json", "--metadata", "etcd://h:1", "--cluster", "c", "--timeout", "3",
     "--admin-token-file", "t"],
    ["admin", "--metadata", "etcd://h:9", "status", "--json", "--cluster", "c", "--timeout", "3", "--token-file", "t"],
])
def test_admin_global_flags_go_before_or_after_the_subcommand(argv):
    """Kills: `kvstore admin status --json` refused as an unknown argument (the flags existed only
    on `kvstore admin`)."""
    args = parse(argv)
    assert args.json is True and args.cluster == "c" and args.timeout == 3.0 and args.admin_token_file == "t"
    assert args.metadata.startswith("etcd://h:")


def test_admin_flags_after_the_subcommand_override_and_defaults_stay():
    args = parse(["admin", "--metadata", "etcd://h:1", "--timeout", "3", "nodes", "--metadata", "etcd://h:2"])
    assert args.metadata == "etcd://h:2" and args.timeout == 3.0 and args.json is False
    assert parse(["admin", "nodes"]).timeout == 10.0


# --- --version and --help ------------------------------------------------------------------------------

@pytest.mark.parametrize("module, argv", [
    ("kvstore.cli", ["--version"]), ("kvstore.cli", ["serve", "--version"]), ("kvstore.cli", ["admin", "--version"]),
    ("conductor.cli", ["--version"]), ("conductor.cli", ["serve", "--version"]), ("conductor.sim.__main__", ["--version"]),
])
def test_every_command_line_prints_the_package_version(capsys, module, argv):
    """Kills: no --version on a CLI (argparse: 'unrecognized arguments'), or one printing something else."""
    import importlib

    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(argv)
    assert done.value.code == 0
    assert capsys.readouterr().out.strip().endswith(VERSION)


@pytest.mark.parametrize("module, argv, shown", [
    ("kvstore.cli", ["serve", "--help"], ["(default: 1GiB)", "(default: 4GiB)", "(default: 0.95)", "(default: 127.0.0.1)",
                                          "(default: info)", "(default: 0)"]),
    ("kvstore.cli", ["admin", "--help"], ["(default: 10.0)", "$KVSTORE_METADATA"]),
    ("kvstore.cli", ["admin", "blocks", "--help"], ["(default: 100)"]),
    ("conductor.cli", ["serve", "--help"], ["(default: 127.0.0.1:0)", "(default: 30000.0)"]),
    ("conductor.sim.__main__", ["--help"], ["(default: 8)", "(default: 30000)"]),
])
def test_help_shows_defaults(capsys, module, argv, shown):
    """Kills: --help listing flags without their defaults (plain argparse.HelpFormatter)."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(argv)
    out = " ".join(capsys.readouterr().out.split())
    for text in shown:
        assert text in out, text


# --- one spelling per flag, old ones hidden ------------------------------------------------------------

def test_renamed_flags_keep_their_old_spelling_hidden(capsys):
    """Kills: dropping an old spelling (scripts using `--disk 8GiB`, `--high 0.9`, `--token-file`,
    `--ttft-slo-ms` break) or listing both spellings in --help."""
    args = parse(["serve", "--node", "a", "--disk-dir", "/d", "--disk", "8MiB", "--high", "0.9", "--low", "0.5",
                  "--token-file", "t"])
    assert (args.disk_size, args.high_watermark, args.low_watermark, args.admin_token_file) == ("8MiB", 0.9, 0.5, "t")
    new = parse(["serve", "--node", "a", "--disk-size", "8MiB", "--high-watermark", "0.9", "--admin-token-file", "t"])
    assert (new.disk_size, new.high_watermark, new.admin_token_file) == ("8MiB", 0.9, "t")
    policy = parse(["admin", "policy", "n", "--high", "0.9", "--low", "0.5"])
    assert (policy.high_watermark, policy.low_watermark) == (0.9, 0.5)
    assert parse(["admin", "policy", "n", "--high-watermark", "0.8"]).high_watermark == 0.8
    assert parse(["admin", "--token-file", "t", "nodes"]).admin_token_file == "t"
    with pytest.raises(SystemExit):
        kvstore_main(["serve", "--help"])
    serve_help = capsys.readouterr().out
    assert "--disk-size" in serve_help and "--disk " not in serve_help and "--high " not in serve_help
    assert "--token-file" not in serve_help.replace("--admin-token-file", "")

    from conductor.cli import build_parser
    from conductor.sim.__main__ import main as sim_main

    assert build_parser().parse_args(["serve", "--ttft-slo-ms", "5"]).slo_ttft_ms == 5.0
    with pytest.raises(SystemExit):
        sim_main(["--help"])
    sim_help = capsys.readouterr().out
    assert "--slo-ttft-ms" in sim_help and "--ttft-slo-ms" not in sim_help


def test_sim_takes_the_spelling_conductor_serve_takes(tmp_path):
    """Kills: `python -m conductor.sim --slo-ttft-ms` refused while `conductor serve` takes only that."""
    import json

    from conductor.sim.__main__ import main as sim_main

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i * 100, "input_length": 1024, "output_length": 8,
                                           "hash_ids": [1, 2]}) for i in range(3)))
    for flag in ("--slo-ttft-ms", "--ttft-slo-ms"):
        out = tmp_path / f"out{flag}.json"
        assert sim_main(["--trace", str(trace), "--policy", "round_robin", flag, "1", "--json", str(out)]) == 0
        assert "round_robin" in json.loads(out.read_text())


# --- kvstore serve --config --------------------------------------------------------------------------

def test_config_file_gives_flags_and_the_command_line_wins(tmp_path):
    """Kills: --config ignored, or its values beating the flags given on the command line."""
    config = tmp_path / "node.toml"
    config.write_text('node = "from-file"\nmetadata = "etcd://127.0.0.1:2379"\ndram = "2GiB"\ndisk-dir = "/nvme"\n'
                      'disk_size = "8GiB"\ninsecure = true\nmetrics-port = 9100\nhigh-watermark = 0.9\n')
    args = parse(["serve", "--config", str(config), "--dram", "4GiB"])
    assert (args.node, args.metadata, args.dram, args.disk_dir, args.disk_size) == \
        ("from-file", "etcd://127.0.0.1:2379", "4GiB", "/nvme", "8GiB")
    assert args.insecure is True and args.metrics_port == 9100 and args.high_watermark == 0.9
    assert parse(["serve", f"--config={config}", "--node", "cli"]).node == "cli"


@pytest.mark.parametrize("text, says", [
    ('node = "a"\ncolour = "blue"\n', "unknown key 'colour'"),
    ('node = "a"\ndram = "16XB"\n', "dram"),
    ('node = "a"\ninsecure = "yes"\n', "true or false"),
    ('node = "a"\neviction = "fifo"\n', "lru"),
    ('node = "a"\nreplicas = [1]\n', "string or a number"),
    ("node = \n", "not TOML"),
])
def test_config_file_mistakes_are_one_line(capsys, tmp_path, text, says):
    """Kills: an unknown key silently ignored, a bad value or a TOML syntax error as a traceback."""
    config = tmp_path / "node.toml"
    config.write_text(text)
    err = one_line_error(capsys, lambda: parse(["serve", "--config", str(config)]))
    assert says in err and "--config" in err


def test_config_file_may_be_json_like_the_gateways(tmp_path, capsys):
    """Kills: a .json config read as TOML (refused), which leaves Python 3.10 without a config file."""
    config = tmp_path / "node.json"
    config.write_text('{"node": "j", "disk_size": "2GiB", "no-promote": true}')
    args = parse(["serve", "--config", str(config)])
    assert (args.node, args.disk_size, args.no_promote) == ("j", "2GiB", True)
    config.write_text('["node", "j"]')
    assert "JSON object" in one_line_error(capsys, lambda: parse(["serve", "--config", str(config)]))


def test_config_file_missing_is_one_line(capsys):
    err = one_line_error(capsys, lambda: parse(["serve", "--config", "/nonexistent.toml", "--node", "a"]))
    assert "/nonexistent.toml" in err


# --- secret and admin token files ------------------------------------------------------------------------

def test_a_missing_admin_token_file_is_created_private_like_the_secret(tmp_path, capsys, monkeypatch):
    """Kills: `--admin-token-file PATH` with no file at PATH ending in a FileNotFoundError traceback."""
    from kvstore.cli import ensure_admin_token

    monkeypatch.delenv("KVSTORE_ADMIN_TOKEN", raising=False)
    path = tmp_path / "sub" / "admin-token"
    token = ensure_admin_token(str(path), "c", insecure=False)
    assert len(token) >= 32 and path.read_text().strip() == token
    assert path.stat().st_mode & 0o777 == 0o600
    assert "generated an admin token in" in capsys.readouterr().err
    assert ensure_admin_token(str(path), "c", insecure=True) == token  # read back, not replaced
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        ensure_admin_token(str(empty), "c", insecure=False)


def test_secure_nodes_get_an_admin_token_by_default(tmp_path, monkeypatch):
    """Kills: a node with a cluster secret taking drain, evict and policy calls from anyone (no token
    unless --admin-token-file was given); --insecure keeps them open, as before."""
    from kvstore.cli import ensure_admin_token

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KVSTORE_ADMIN_TOKEN", raising=False)
    assert ensure_admin_token(None, "c1", insecure=True) is None
    token = ensure_admin_token(None, "c1", insecure=False)
    path = tmp_path / ".kvstore" / "c1.admin-token"
    assert path.read_text().strip() == token and path.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("KVSTORE_ADMIN_TOKEN", "from-env")
    assert ensure_admin_token(None, "c1", insecure=False) == "from-env"


def test_unreadable_token_file_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTORE_ADMIN_TOKEN", raising=False)
    err = one_line_error(capsys, lambda: kvstore_main(["serve", "--node", "a", "--insecure", "--metadata", "memory://x",
                                                       "--admin-token-file", str(tmp_path)]))  # a folder
    assert "--admin-token-file" in err


def test_license_is_the_apache_license():
    """Kills: no LICENSE file although pyproject.toml says Apache-2.0."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("flags", [["--keep-disk"], ["--persist-on-stop"], ["--disk-codec", "lz4"]])
def test_nvme_tier_flags_without_a_tier_are_one_line(capsys, flags):
    """Kills: a persistent-tier or codec flag silently ignored when there is no NVMe tier."""
    err = one_line_error(capsys, lambda: kvstore_main(["serve", "--node", "a", "--metadata", "memory://x",
                                                        "--insecure", *flags]))
    assert flags[0] in err and "--disk-dir" in err
