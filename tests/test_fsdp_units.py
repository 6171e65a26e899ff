"""parallel.fsdp_unit_blocks: consecutive blocks share one FSDP2 unit (one all-gather, one reduce-scatter), on a fake
process group so no other process is needed. Numerical parity of a grouped layout with one process is in
tests/test_parallel_layouts.py (fsdp2_units2)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshrun.config import ConfigError, load_config
from meshrun.parallel.data_parallel import apply_fsdp


class Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(n)})


def _units(model: Blocks) -> list[list[str]]:
    """Block names grouped by the FSDP2 parameter group that gathers them."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, list[str]] = {}
    for name, block in model.layers.items():
        assert isinstance(block, FSDPModule), name
        group = block._get_fsdp_state()._fsdp_param_group
        groups.setdefault(id(group), []).append(name)
    return list(groups.values())


@pytest.mark.parametrize("unit_blocks, expected", [(1, [["0"], ["1"], ["2"], ["3"], ["4"]]),
                                                   (2, [["0", "1"], ["2", "3"], ["4"]]),
                                                   (8, [["0", "1", "2", "3", "4"]])])
def test_blocks_are_grouped_into_units_of_the_given_size(unit_blocks, expected):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = Blocks(5)
        apply_fsdp(model, init_device_mesh("cpu", (2,)), compute_dtype=None, reshard_after_forward=True,
                   blocks=list(model.layers.values()), unit_blocks=unit_blocks)
        assert _units(model) == expected
        assert [p.to_local().shape[0] for p in model.layers["0"].parameters()] == [2, 2]  # sharded over 2 ranks
    finally:
        dist.destroy_process_group()


def test_unit_size_below_zero_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"parallel.fsdp_unit_blocks must be >= 0 \(blocks per FSDP2 unit; 0: auto\)"):
        load_config(None, ["--parallel.fsdp_unit_blocks=-1"])


def test_auto_units_put_a_small_models_blocks_in_one_unit_on_gpus_only():
    from meshrun.parallel.apply import FSDP_ONE_UNIT_PARAMS, unit_blocks

    small = Blocks(5)
    blocks = list(small.layers.values())
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")  # only the device's type is read
    assert unit_blocks(0, small, blocks, device=gpu) == 5  # one unit: 376.8k against 226.4k tokens/s on 2x H100
    assert unit_blocks(0, small, blocks, device=cpu) == 1 and unit_blocks(0, small, blocks, device=None) == 1
    assert unit_blocks(2, small, blocks, device=gpu) == 2  # a number given is kept
    with torch.device("meta"):
        large = nn.Linear(FSDP_ONE_UNIT_PARAMS // 1000, 1000)  # as big as the threshold, on the meta device
    assert unit_blocks(0, large, [large], device=gpu) == 1
