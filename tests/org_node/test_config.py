"""The node config file: round trip, unknown keys and invalid values name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from org_node.config import ConfigError, NetworkSection, NodeConfig, NodeSection
from org_node.engine import EngineConfig, TrainingConfig


def full_config() -> NodeConfig:
    return NodeConfig(
        node=NodeSection("hospital-a", "Hospital A", "fed-1"),
        network=NetworkSection(peer_port=9001, admin_port=9002),
        training=TrainingConfig(local_steps=None, time_budget_s=2.5, dirichlet_alpha=0.5),
        engine=EngineConfig(strategy="fedprox", strategy_options={"mu": 0.1}, fednova=False),
    )


def test_round_trip_through_toml(tmp_path: Path) -> None:
    config = full_config()
    path = tmp_path / "fedweave.toml"
    config.save(path)
    assert path.stat().st_mode & 0o077 == 0
    assert NodeConfig.load(path) == config


def test_defaults_from_a_minimal_file() -> None:
    config = NodeConfig.loads('[node]\norg_id = "a"\n')
    assert config.network.peer_port == 8471
    assert config.engine == EngineConfig()
    assert config.debug.harness is False
    assert config.network.peer_url == "https://127.0.0.1:8471"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[node]\norg_id = "a"\nnick = "x"\n', "node.nick"),
        ('[node]\norg_id = "a"\n[extra]\nx = 1\n', "config.extra"),
        ("[network]\npeer_port = 1\n", "node"),
        ('[node]\norg_id = "_a"\n', "node.org_id"),
        ('[node]\norg_id = "a b"\n', "node.org_id"),
        ('[node]\norg_id = "a"\n[network]\npeer_port = 70000\n', "network.peer_port"),
        ('[node]\norg_id = "a"\n[network]\npeer_port = 1\nadmin_port = 1\n', "network.admin_port"),
        ('[node]\norg_id = "a"\n[network]\nadmin_host = "10.0.0.1"\n', "network.admin_host"),
        ('[node]\norg_id = "a"\n[network]\nadvertise_url = "http://x"\n', "network.advertise_url"),
        ('[node]\norg_id = "a"\n[engine]\nstrategy = "sgd"\n', "engine.strategy"),
        ('[node]\norg_id = "a"\n[engine]\nrounds = 3\n', "engine.rounds"),
        ('[node]\norg_id = "a"\n[training]\nlr = -1.0\n', "training.lr"),
        ('[node]\norg_id = "a"\n[training]\nbatch = 3\n', "training.batch"),
        ('[node]\norg_id = "a"\n[checkpoint]\nk = 0\n', "checkpoint.k"),
        ('[node]\norg_id = "a"\n[debug]\nharness = "yes"\n', "debug.harness"),
    ],
)
def test_errors_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        NodeConfig.loads(text)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_bad_toml_and_missing_file_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        NodeConfig.loads("[node\n")
    with pytest.raises(ConfigError, match="cannot read"):
        NodeConfig.load(tmp_path / "absent.toml")


def test_remote_admin_needs_the_explicit_flag() -> None:
    section = NetworkSection(admin_host="0.0.0.0", allow_remote_admin=True)
    assert section.admin_host == "0.0.0.0"
    assert NetworkSection(peer_host="0.0.0.0", peer_port=5).peer_url == "https://127.0.0.1:5"


def _round_config_setting(
    tmp_path: Path, port: int, written: str, edited: str, name: str
) -> tuple[object, object]:
    """A node made by ``fedweave init`` (its config must show the line ``written``): the
    node's ``round_config.<name>`` as written, then with the line changed to ``edited``."""
    from org_node.initialize import initialize
    from org_node.node import OrgNode

    initialize(tmp_path / "n", "org-n", peer_port=port, admin_port=port + 1)
    path = tmp_path / "n" / "fedweave.toml"
    assert written in path.read_text()
    seen = []
    for text in (written, edited):
        path.write_text(path.read_text().replace(written, text))
        node = OrgNode.open(tmp_path / "n")
        try:
            seen.append(getattr(node.round_config, name))
        finally:
            node.egress.close()
        path.write_text(path.read_text().replace(text, written))
    return seen[0], seen[1]


def test_the_engine_s_mask_helper_reaches_the_node_s_rounds(tmp_path: Path) -> None:
    _, edited = _round_config_setting(
        tmp_path, 9320, 'mask_helper = "auto"', 'mask_helper = "thread"', "mask_helper"
    )
    assert edited == "thread"


def test_the_engine_s_prepared_masks_reach_the_node_s_rounds(tmp_path: Path) -> None:
    as_written, edited = _round_config_setting(
        tmp_path, 9324, "prepared_masks_mb = 64", "prepared_masks_mb = 0", "prepared_masks_bytes"
    )
    assert as_written == 64 << 20
    assert edited is None


def test_the_engine_s_ring_first_reaches_the_node_s_rounds(tmp_path: Path) -> None:
    as_written, edited = _round_config_setting(
        tmp_path, 9322, "ring_first = true", "ring_first = false", "ring_first"
    )
    assert as_written is True
    assert edited is False
