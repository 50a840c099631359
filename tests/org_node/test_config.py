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


def test_the_engine_s_mask_helper_reaches_the_node_s_rounds(tmp_path: Path) -> None:
    from org_node.initialize import initialize
    from org_node.node import OrgNode

    initialize(tmp_path / "n", "org-n", peer_port=9320, admin_port=9321)
    path = tmp_path / "n" / "fedweave.toml"
    assert 'mask_helper = "auto"' in path.read_text()
    path.write_text(path.read_text().replace('mask_helper = "auto"', 'mask_helper = "thread"'))
    node = OrgNode.open(tmp_path / "n")
    try:
        assert node.round_config.mask_helper == "thread"
    finally:
        node.egress.close()


def test_the_engine_s_prepared_masks_reach_the_node_s_rounds(tmp_path: Path) -> None:
    from org_node.initialize import initialize
    from org_node.node import OrgNode

    initialize(tmp_path / "n", "org-n", peer_port=9324, admin_port=9325)
    path = tmp_path / "n" / "fedweave.toml"
    assert "prepared_masks_mb = 64" in path.read_text()
    node = OrgNode.open(tmp_path / "n")
    try:
        assert node.round_config.prepared_masks_bytes == 64 << 20
    finally:
        node.egress.close()
    path.write_text(path.read_text().replace("prepared_masks_mb = 64", "prepared_masks_mb = 0"))
    node = OrgNode.open(tmp_path / "n")
    try:
        assert node.round_config.prepared_masks_bytes is None
    finally:
        node.egress.close()


def test_the_engine_s_ring_first_reaches_the_node_s_rounds(tmp_path: Path) -> None:
    from org_node.initialize import initialize
    from org_node.node import OrgNode

    initialize(tmp_path / "n", "org-n", peer_port=9322, admin_port=9323)
    path = tmp_path / "n" / "fedweave.toml"
    assert "ring_first = true" in path.read_text()
    node = OrgNode.open(tmp_path / "n")
    try:
        assert node.round_config.ring_first is True
    finally:
        node.egress.close()
    path.write_text(path.read_text().replace("ring_first = true", "ring_first = false"))
    node = OrgNode.open(tmp_path / "n")
    try:
        assert node.round_config.ring_first is False
    finally:
        node.egress.close()
