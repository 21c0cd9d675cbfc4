"""How many gateways and tokenizers `kvmesh up` starts: from the host's cores unless told, and
each gateway's name, tokenizer, ports and peers."""

from __future__ import annotations

from kvmesh.cli import build_parser
from kvmesh.mesh import gateways
from kvmesh.mesh.config import MeshConfig
from kvmesh.mesh_cli import mesh_config


def test_counts_follow_the_cores_and_the_flags() -> None:
    assert [gateways.default_gateways(cores) for cores in (1, 2, 4, 16, 64)] == [1, 1, 1, 4, 16]
    assert [gateways.default_tokenizers(n) for n in (1, 2, 3, 4)] == [1, 1, 1, 2]
    config = mesh_config(build_parser().parse_args(["up", "--gateways", "3"]), models=[])
    assert (config.gateways, config.tokenizers) == (3, 1)
    config = mesh_config(
        build_parser().parse_args(["up", "--gateways", "4", "--tokenizers", "3"]), models=[]
    )
    assert (config.gateways, config.tokenizers) == (4, 3)


def test_names_and_stages() -> None:
    assert gateways.names("gateway", 1) == ["gateway"]
    assert gateways.names("tokenizer", 3) == ["tokenizer-0", "tokenizer-1", "tokenizer-2"]
    assert gateways.stage_of("gateway") == gateways.stage_of("gateway-12") == "gateway"
    assert gateways.stage_of("gateway-x") != "gateway"
    assert gateways.stage_of("embedder-0") != "gateway"


def test_several_gateways_share_a_port_and_spread_over_the_tokenizers() -> None:
    started: list[tuple[str, list[str], int | None]] = []

    def spawn(name: str, module: str, args: list[str], port: int | None = None) -> str:
        started.append((name, args, port))
        return f"127.0.0.1:{7000 + len(started)}"

    config = MeshConfig(gateways=3, gateway_port=9100)
    address = gateways.start(config, spawn, ["t0:1", "t1:1"], ["--redis", "r"])
    assert address == "127.0.0.1:9100"  # the shared port, not any gateway's own
    assert [name for name, _, _ in started] == ["gateway-0", "gateway-1", "gateway-2"]
    assert [args[args.index("--tokenizer") + 1] for _, args, _ in started] == [
        "t0:1",
        "t1:1",
        "t0:1",
    ]
    ports = [port for _, _, port in started]
    assert len(set(ports)) == 3 and 9100 not in ports  # each its own, beside the shared one
    for _, args, _ in started:
        assert args[args.index("--shared-port") + 1] == "9100"
        peers = args[args.index("--peers") + 1].split(",")
        assert peers == [f"127.0.0.1:{port}" for port in ports]  # Abort asks the others
        assert args[-2:] == ["--redis", "r"]
    started.clear()
    one = gateways.start(MeshConfig(gateway_port=9100), spawn, ["t0:1"], [])
    assert (
        one == "127.0.0.1:7001" and started[0][2] == 9100 and "--shared-port" not in started[0][1]
    )
