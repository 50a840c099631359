"""The ``[membership]`` table of ``fedweave.toml``: SWIM's timing as the operator sets it,
errors naming ``membership.KEY``, and the harness's fast timing on top of it."""

from __future__ import annotations

import pytest
from coordinator_free.membership import SwimConfig

from org_node.config import ConfigError, DebugSection, NodeConfig
from org_node.node.assembly import _swim_config

BASE = '[node]\norg_id = "org-a"\n'


def test_membership_table_is_read_and_written_back() -> None:
    config = NodeConfig.loads(BASE + "[membership]\nperiod_s = 2.0\nmax_ping_timeout_s = 8.0\n")
    assert config.membership == SwimConfig(period_s=2.0, max_ping_timeout_s=8.0)
    assert NodeConfig.loads(config.to_toml()) == config
    assert NodeConfig.loads(BASE).membership == SwimConfig()


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ("period_s = 0", "membership.period_s"),
        ("ping_timeout_s = 0.9", "membership.ping_timeout_s"),
        ("max_ping_timeout_s = 0.1", "membership.max_ping_timeout_s"),
        ("local_health_max = 0", "membership.local_health_max"),
        ("indirect_k = 1.5", "membership.indirect_k"),
        ("suspicion_periods = 3", "membership.suspicion_periods"),
    ],
)
def test_membership_errors_name_the_key(table: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        NodeConfig.loads(BASE + "[membership]\n" + table + "\n")
    assert info.value.field == field
    assert "SwimConfig" not in str(info.value)


def test_fast_membership_keeps_the_operators_other_knobs() -> None:
    config = NodeConfig.loads(BASE + "[membership]\nlocal_health_max = 3\n")
    assert _swim_config(config) == config.membership
    fast = _swim_config(config.replace(debug=DebugSection(fast_membership=True)))
    assert (fast.period_s, fast.ping_timeout_s, fast.max_ping_timeout_s) == (0.2, 0.08, 2.0)
    assert fast.local_health_max == 3
