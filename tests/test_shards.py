"""The layouts no CPU run can build end to end (DeepSpeed ZeRO-1/2 and ZeRO-3, FSDP1), measured in-process on
stand-ins: a trainer that says what it runs, and ZeRO-3 parameters made as DeepSpeed makes them (locally empty,
this rank's flat partition in ``ds_tensor``, padded with values never written). FSDP2 runs for real under
torchrun in tests/test_fsdp.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hf_sanity.training import shards
from hf_sanity.training.measures import StepSampler
from hf_sanity.training.ranks import RankExchange
from hf_sanity.training.recorder import Recorder

DEEPSPEED = SimpleNamespace(is_deepspeed_enabled=True, is_fsdp_enabled=False)
FSDP = SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=True)


def wants_all(*slugs: str) -> bool:
    return True


def sampler(model, trainer=None) -> StepSampler:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = SimpleNamespace(gradient_accumulation_steps=1, get_warmup_steps=lambda steps: 0)
    return StepSampler(trainer, model, optimizer, args, SimpleNamespace(max_steps=10), wants_all)


def partitioned(param: torch.nn.Parameter, padding: int = 4) -> torch.Tensor:
    """``param`` as ZeRO-3 leaves it on a single rank: empty, its values in ``ds_tensor`` followed by padding
    DeepSpeed never writes (garbage here). Returns the full values."""
    full = param.detach().clone()
    param.ds_tensor = torch.cat([full.reshape(-1), torch.full((padding,), 1e6)])
    param.ds_id, param.ds_numel = id(param), full.numel()
    param.data = torch.empty(0)
    return full


def test_a_plain_model_is_replicated_and_skips_nothing():
    sharding = shards.detect(None, torch.nn.Linear(3, 2))
    assert (sharding.kind, sharding.sharded, sharding.skipped) == ("replicated", False, {})
    assert sharding.replicated == ["weight", "bias"]


def test_zero3_partitions_are_read_without_their_padding():
    layer = torch.nn.Linear(4, 3)
    full = partitioned(layer.weight)
    assert layer.weight.numel() == 0 and shards.full_numel(layer.weight) == 12
    assert torch.equal(shards.local_tensor(layer.weight), full.reshape(-1))  # the 1e6 padding left out
    assert (
        shards.layout_of(layer.weight) == shards.ZERO3 and shards.layout_of(layer.bias) == shards.REPLICATED
    )


def test_zero3_update_ratio_is_the_whole_tensors_measured_from_step_begin():
    """DeepSpeed's engine steps inside backward: the update is measured from the start of the step; on ZeRO-3
    parameters it is read in the partitions, whose padding changes nothing."""
    layer = torch.nn.Linear(4, 3)
    full = partitioned(layer.weight)
    bias = layer.bias.detach().clone()
    measured = sampler(layer, DEEPSPEED)
    sharding = measured.sharding
    assert sharding.kind == "zero3" and sharding.replicated == ["bias"]  # ranks-diverged: the bias only
    assert measured.stale_sample == [] and measured.watches_step_begin
    recorder = Recorder()
    measured.step_begins(recorder, 1)
    with torch.no_grad():  # what the engine's step does inside backward: the partitions move in place
        layer.weight.ds_tensor[:12] += 0.01
        layer.weight.ds_tensor[12:] = -7.0  # padding is never read
        layer.bias += 0.02
    measured.before_optimizer(recorder, 1, None)
    measured.after_optimizer(recorder, 1)
    values = recorder.read()[1]
    expected = sorted([0.01 * math.sqrt(12) / float(full.norm()), 0.02 * math.sqrt(3) / float(bias.norm())])
    assert values["update_ratio"][0] == pytest.approx(expected[0], rel=1e-4)  # torch's median: the lower one
    assert values["updated"] == [1.0]
    assert "n_with_grad" not in values  # the engine keeps gradients in its own buffers: p.grad says nothing
    assert {"nonfinite-loss replay", "probe forward", "stale-gradients", "ranks-diverged"} <= set(
        sharding.skipped
    )


def test_deepspeed_zero12_compares_replicas_and_skips_the_replay_only():
    model = torch.nn.Linear(3, 2)
    sharding = sampler(model, DEEPSPEED).sharding
    assert (sharding.kind, sharding.sharded, sharding.probe_skip) == ("deepspeed", False, None)
    assert sharding.replicated == ["weight", "bias"]  # ZeRO-1/2 parameters are whole on every rank
    assert sharding.replay_skip and "ranks-diverged" not in sharding.skipped


def test_fsdp1_measures_nothing_it_cannot_sample_alike_on_every_rank():
    model = torch.nn.Linear(3, 2)
    measured = sampler(model, FSDP)  # FSDP by the trainer's word and no DTensor: FSDP1
    sharding = measured.sharding
    assert sharding.kind == "fsdp1" and sharding.replicated == []
    assert measured.update_sample == [] and measured.stale_sample == [] and measured.optimizer_ids is None
    assert {"update ratio", "stale-gradients", "probe forward", "nonfinite-loss replay"} <= set(
        sharding.skipped
    )
    recorder = Recorder()
    measured.before_optimizer(recorder, 1, None)
    assert "n_with_grad" not in recorder.read().get(1, {})


def test_the_exchange_compares_the_names_fixed_at_train_begin():
    model = torch.nn.Linear(3, 2)
    exchange = RankExchange(0, 2, compared=["bias"])
    assert [name for name, _ in exchange.compared(model)] == ["bias"]
    assert [name for name, _ in RankExchange(0, 2).compared(model)] == ["weight", "bias"]


def test_plain_values_and_models_pass_through():
    norm = torch.tensor(2.0)
    assert shards.plain(norm) is norm
    model = torch.nn.Linear(3, 2)
    before = list(model.parameters())
    with shards.kept_sharded(model):
        model(torch.ones(1, 3))
    assert list(model.parameters()) == before
