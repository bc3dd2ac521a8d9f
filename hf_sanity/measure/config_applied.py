"""Whether a model's config still describes the model: fields that shape the forward which its modules read once,
when they were built, set on the config of a model already built.

transformers builds the rotary embedding's frequencies (``inv_freq``) and attention scaling from
``rope_parameters`` in the module's ``__init__``: RoPE scaling or a new ``rope_theta`` set on a loaded model's
config changes nothing it computes, while ``save_pretrained`` writes the new values, so every reload and server
builds another model than the one trained. Each rotary module is rebuilt from a copy of its config and compared
with the one in the model. ``attn_implementation`` set as a plain attribute is written to config.json too and
never read by the model; a MoE model reads ``router_aux_loss_coef`` once, when built.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any

ROTARY_BUFFERS = (
    "original_inv_freq",
    "inv_freq",
)  # the init-time frequencies (dynamic RoPE updates inv_freq)
HALF_TOLERANCE, FULL_TOLERANCE = 1e-2, 1e-5  # relative, by the buffer's dtype: rounding, not another RoPE


def rope_not_applied(model) -> list[dict[str, Any]]:
    """Rotary modules whose frequencies or scaling differ from what their config builds now, one entry per
    distinct difference: the module, what it was built with and what the config declares; or the error the
    config raises when it builds (a config that no longer builds: the saved model will not load)."""
    from hf_sanity.measure.moe import base_model

    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for name, module in base_model(model).named_modules():
        if not _rebuildable(module):
            continue
        try:
            fresh = type(module)(config=copy.deepcopy(module.config))
        except Exception as exc:  # the declared config does not build a rotary embedding at all
            entry = {"module": name, "rebuild_error": f"{type(exc).__name__}: {exc}"}
        else:
            entry = _differences(name, module, fresh)
        if entry is None:
            continue
        entry["declared"] = _jsonable(getattr(module.config, "rope_parameters", None))
        key = repr({k: v for k, v in entry.items() if k != "module"})
        if key not in seen:  # one model usually shares one rotary module; a VLM may have one per tower
            seen.add(key)
            out.append(entry)
    return out


def _rebuildable(module) -> bool:
    """A transformers rotary embedding of one RoPE type (not one per layer type), built from ``config`` alone."""
    if not all(hasattr(module, attr) for attr in ("inv_freq", "rope_type", "config")):
        return False
    if not isinstance(module.rope_type, str) or not hasattr(module.config, "rope_parameters"):
        return False
    try:
        params = inspect.signature(type(module).__init__).parameters
    except (TypeError, ValueError):
        return False
    required = [
        p
        for n, p in params.items()
        if n != "self"
        and p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return "config" in params and all(p.name == "config" for p in required)


def _differences(name: str, built, fresh) -> dict[str, Any] | None:
    import torch

    entry: dict[str, Any] = {"module": name}
    if built.rope_type != fresh.rope_type:
        entry["rope_type"] = {"built": built.rope_type, "declared": fresh.rope_type}
    scaling = (
        float(getattr(built, "attention_scaling", 1.0)),
        float(getattr(fresh, "attention_scaling", 1.0)),
    )
    if not math.isclose(*scaling, rel_tol=1e-6):
        entry["attention_scaling"] = {"built": scaling[0], "declared": scaling[1]}
    buffer = next((b for b in ROTARY_BUFFERS if isinstance(getattr(built, b, None), torch.Tensor)), None)
    have, want = getattr(built, buffer, None), getattr(fresh, buffer, None)
    if isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor):
        have, want = have.detach().float().cpu(), want.detach().float().cpu()
        tolerance = (
            HALF_TOLERANCE if built.inv_freq.dtype in (torch.float16, torch.bfloat16) else FULL_TOLERANCE
        )
        if have.shape != want.shape:
            entry["inv_freq"] = {"built_size": list(have.shape), "declared_size": list(want.shape)}
        else:
            gap = float(((have - want).abs() / want.abs().clamp(min=1e-30)).max())
            if gap > tolerance:
                entry["inv_freq"] = {
                    "built": [round(float(v), 6) for v in have[:3]],
                    "declared": [round(float(v), 6) for v in want[:3]],
                    "max_relative_gap": gap,
                }
    return entry if len(entry) > 1 else None


def attention_not_applied(model) -> dict[str, Any] | None:
    """``attn_implementation`` set on the config as a plain attribute (saved to config.json, read by every
    reload) that is not the implementation the model runs (``config._attn_implementation``); None when they
    agree or it was not set."""
    from hf_sanity.measure.moe import base_model

    config = getattr(base_model(model), "config", None)
    declared = vars(config).get("attn_implementation") if config is not None else None
    effective = getattr(config, "_attn_implementation", None)
    if not isinstance(declared, str) or declared == effective:
        return None
    return {"declared": declared, "effective": effective}


def aux_coefficient_not_applied(model) -> dict[str, Any] | None:
    """A mixture of experts whose config's ``router_aux_loss_coef`` is not the one its forward weighs the
    load-balancing loss with (read from the config once, when the model was built); None when they agree."""
    from hf_sanity.measure.moe import as_number, base_model, text_config

    base = base_model(model)
    built = as_number(getattr(base, "router_aux_loss_coef", None))
    declared = as_number(getattr(text_config(base), "router_aux_loss_coef", None))
    if built is None or declared is None or math.isclose(built, declared, rel_tol=1e-9):
        return None
    return {"declared": declared, "built": built}


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)
