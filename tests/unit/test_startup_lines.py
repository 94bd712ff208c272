"""The one INFO line the daemon and the gateway log once they serve: what, where, tiers and sizes,
auth on or off, and no secret in it."""
from __future__ import annotations

from types import SimpleNamespace

from conductor.gateway import GatewayConfig
from conductor.gateway.serve import startup_line as gateway_line
from kvstore.daemon import DaemonConfig
from kvstore.daemon.startup import startup_line as daemon_line


def test_the_daemon_says_what_it_serves_and_names_no_secret():
    config = DaemonConfig(node="n1", metadata="etcd://user:pw@10.0.0.5:2379", cluster="prod", dram_bytes=64 << 30,
                          disk_dir="/nvme", disk_bytes=3 << 40, keep_disk=True, secret="s" * 32,
                          admin_token="t" * 32, metrics_port=0)
    daemon = SimpleNamespace(address="10.0.0.7:50051", metrics_port=9100,
                             local=SimpleNamespace(tcp_address="10.0.0.7:50052"))
    line = daemon_line(config, daemon)
    for part in ("node n1", "'prod'", "control 10.0.0.7:50051", "wire 10.0.0.7:50052", "metrics 127.0.0.1:9100",
                 "dram 64GiB", "nvme 3TiB at /nvme (kept across restarts)", "etcd://10.0.0.5:2379",
                 "auth cluster secret, admin token"):
        assert part in line, (part, line)
    assert "pw" not in line and "s" * 32 not in line and "t" * 32 not in line and "\n" not in line
    insecure = daemon_line(DaemonConfig(node="n2", metadata="memory://x", insecure=True, dram_bytes=1 << 30),
                           SimpleNamespace(address="a:1", metrics_port=None, local=SimpleNamespace(tcp_address=None)))
    assert "auth off (--insecure)" in insecure and "nvme" not in insecure and "metrics off" in insecure


def test_the_gateway_says_where_in_front_of_what_and_whether_keys_bind_salts():
    keyed = gateway_line(GatewayConfig(decode=["http://d:8000"], prefill=["http://p:8000"], api_keys=["sk-secret-1"],
                                       metadata="etcd://e:2379"), "0.0.0.0:8080")
    for part in ("http://0.0.0.0:8080", "decode http://d:8000; prefill http://p:8000", "store index etcd://e:2379",
                 "1 API key(s), cache salts bound to keys"):
        assert part in keyed, (part, keyed)
    assert "sk-secret-1" not in keyed
    open_line = gateway_line(GatewayConfig(decode=["http://d:8000"]), "127.0.0.1:1")
    assert "(colocated)" in open_line and "auth off" in open_line and "no store index" in open_line
