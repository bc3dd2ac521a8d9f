"""Mixture-of-experts facts: where a model routes its tokens, what its adapter reaches, whether its training
loss carries the load-balancing term, and how the tokens of one forward spread over the experts.

A model is *routed* when transformers records its router logits (`_can_record_outputs["router_logits"]`: the
router class of every MoE architecture in transformers 5) and modules of that class are in it; its routed
experts are the modules named ``experts`` (transformers 5's convention: fused ``gate_up_proj``/``down_proj``
parameters, or a list of expert MLPs; a ``shared_expert`` is dense and not one of them).
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

ROUTER_OUTPUT = "router_logits"  # the key transformers records router logits under
EXPERTS = "experts"  # the name of a module holding the routed experts
ADAPTER_MARKERS = (".lora_", ".lora_embedding_")  # parameters a PEFT adapter added
WRAPPERS = ("base_layer",)  # path parts peft inserts when it wraps a module or a parameter
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Routing:
    """Where a model routes its tokens: the router of each MoE layer (module names, in layer order, with the
    index of the router logits in its output), the modules holding its routed experts, and their share of the
    base model's parameters (adapter tensors not counted)."""

    model_class: str
    routers: tuple[str, ...]
    output_index: int
    experts: tuple[str, ...]
    num_experts: int | None
    top_k: int | None
    expert_parameters: int
    parameters: int
    aux_capable: (
        bool  # the config declares `output_router_logits`: the model can return a load-balancing loss
    )

    @property
    def expert_share(self) -> float:
        return self.expert_parameters / self.parameters if self.parameters else 0.0


def base_model(model):
    """The transformers model under the wrappers training puts around it (DDP's ``module``, a PeftModel)."""
    for _ in range(4):
        inner = getattr(model, "module", None)
        if inner is None or not hasattr(inner, "named_modules"):
            break
        model = inner
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def plain_name(name: str) -> str:
    """A module or parameter name without what peft inserts: ``base_model.model.``, ``base_layer`` parts."""
    name = name.removeprefix("base_model.model.")
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def is_adapter_tensor(name: str) -> bool:
    return any(marker in f".{name}" for marker in ADAPTER_MARKERS) or ".modules_to_save." in name


def _recorder(model) -> tuple[tuple[type, ...], str | None, int, str | None] | None:
    """(router classes, router class-name suffix, output index, layer name) transformers records the router
    logits of this model's class from; None for a model that records none (a dense model)."""
    recorders = getattr(type(model), "_can_record_outputs", None) or {}
    spec = recorders.get(ROUTER_OUTPUT) if isinstance(recorders, Mapping) else None
    if spec is None:
        return None
    spec = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    if isinstance(spec, type):
        return (spec,), None, 0, None
    target = getattr(spec, "target_class", None)
    classes = (target,) if isinstance(target, type) else ()
    suffix = getattr(spec, "class_name", None)
    if not classes and not suffix:
        return None
    return classes, suffix, int(getattr(spec, "index", 0) or 0), getattr(spec, "layer_name", None)


@dataclass(frozen=True)
class Routers:
    """The router modules of a model as (plain name, module) in module order, the index of the logits in a
    router's output, and how many experts each token goes to."""

    modules: tuple[tuple[str, Any], ...]
    output_index: int
    top_k: int | None


def routers_of(model) -> Routers | None:
    """The routers of ``model`` (a transformers model, or one wrapped by DDP or peft); None for a dense model."""
    base = base_model(model)
    found = _recorder(base)
    if found is None:
        return None
    classes, suffix, index, layer_name = found
    modules = []
    for name, module in base.named_modules():
        if not (
            (classes and isinstance(module, classes)) or (suffix and type(module).__name__.endswith(suffix))
        ):
            continue
        if layer_name and not plain_name(name).endswith(layer_name):
            continue
        modules.append((plain_name(name), module))
    if not modules:
        return None
    top_k = _first_int(modules[0][1], ("top_k",)) or _first_int(text_config(base), TOP_K_FIELDS)
    return Routers(tuple(modules), index, top_k)


def routing(model) -> Routing | None:
    """The routing facts of ``model`` (a transformers model, or one wrapped by DDP or peft); None for a model
    with no router."""
    routers = routers_of(model)
    if routers is None:
        return None
    base = base_model(model)
    experts = _expert_modules(base)
    total = expert_total = 0
    for name, param in base.named_parameters():
        if is_adapter_tensor(name):
            continue
        total += param.numel()
        if under(plain_name(name), experts):
            expert_total += param.numel()
    config = text_config(base)
    first = routers.modules[0][1]
    return Routing(
        model_class=type(base).__name__,
        routers=tuple(name for name, _ in routers.modules),
        output_index=routers.output_index,
        experts=tuple(experts),
        num_experts=_first_int(first, ("num_experts",)) or _first_int(config, EXPERT_COUNT_FIELDS),
        top_k=routers.top_k,
        expert_parameters=expert_total,
        parameters=total,
        aux_capable=config is not None and hasattr(config, "output_router_logits"),
    )


def text_config(model):
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _first_int(obj, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _expert_modules(base) -> list[str]:
    """The outermost modules named ``experts`` (plain names)."""
    names: list[str] = []
    for name, _ in base.named_modules():
        plain = plain_name(name)
        if plain.rsplit(".", 1)[-1] == EXPERTS and not under(plain, names) and plain not in names:
            names.append(plain)
    return names


def under(name: str, prefixes) -> bool:
    """Whether ``name`` is one of the module names ``prefixes`` or lies inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# -- what an adapter reaches -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterReach:
    """Where the trained tensors of a setup sit: adapter tensors (or parameters trained in full) on the routed
    experts, on the routers, elsewhere; and the targets the adapter was configured with."""

    on_experts: int
    on_routers: int
    elsewhere: int
    router_layers: tuple[str, ...]  # routers that carry an adapter tensor
    target_modules: Any
    target_parameters: Any

    @property
    def total(self) -> int:
        return self.on_experts + self.on_routers + self.elsewhere


def model_reach(model, route: Routing) -> AdapterReach | None:
    """What the adapter attached to ``model`` (a PeftModel, or a model peft injected layers into) reaches, and
    the base parameters trained in full beside it; None without an adapter."""
    config = peft_config_of(model)
    if config is None:
        return None
    base = base_model(model)
    names = [
        plain_name(name)
        for name, param in base.named_parameters()
        if is_adapter_tensor(name) or param.requires_grad
    ]
    return _reach(names, route, config)


def saved_reach(state: Mapping[str, Any], config: Mapping[str, Any], route: Routing) -> AdapterReach:
    """What a saved adapter's tensors (``adapter_model.safetensors``) reach on the model it is attached to."""
    return _reach([plain_name(key) for key in state], route, config)


def peft_config_of(model) -> Any:
    """The config of the adapter attached to ``model`` (the active one), or None."""
    configs = getattr(model, "peft_config", None) or getattr(base_model(model), "peft_config", None)
    if not configs:
        return None
    active = getattr(model, "active_adapter", None)
    active = active[0] if isinstance(active, (list, tuple)) and active else active
    return (
        configs.get(active) if isinstance(active, str) and active in configs else next(iter(configs.values()))
    )


def _reach(names: list[str], route: Routing, config) -> AdapterReach:
    on_experts = on_routers = elsewhere = 0
    routers: set[str] = set()
    for name in names:
        if under(name, route.experts):
            on_experts += 1
        elif under(name, route.routers):
            on_routers += 1
            routers.update(r for r in route.routers if under(name, (r,)))
        else:
            elsewhere += 1
    field = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    return AdapterReach(
        on_experts,
        on_routers,
        elsewhere,
        tuple(r for r in route.routers if r in routers),
        _listed(field("target_modules")),
        _listed(field("target_parameters")),
    )


def _listed(value):
    return sorted(value) if isinstance(value, (set, frozenset, list, tuple)) else value


def expert_targets(model, route: Routing) -> dict[str, list[str]]:
    """The names that reach the routed experts with peft: ``target_parameters`` for the fused expert
    parameters (``mlp.experts.gate_up_proj``: the experts' path from their layer on, and the parameter), and
    ``target_modules`` for experts built of linear layers (their leaf names)."""
    import torch

    base = base_model(model)
    modules = dict(base.named_modules())
    parameters: set[str] = set()
    linear: set[str] = set()
    for raw, module in modules.items():
        name = plain_name(raw)
        if not under(name, route.experts) or "lora_" in raw:
            continue
        if isinstance(module, torch.nn.Linear):
            linear.add(name.rsplit(".", 1)[-1])
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() >= 3 and not is_adapter_tensor(f"{raw}.{param_name}"):
                parameters.add(f"{_from_layer(name)}.{param_name}")
    out: dict[str, list[str]] = {}
    if parameters:
        out["target_parameters"] = sorted(parameters)
    if linear:
        out["target_modules"] = sorted(linear)
    return out


def _from_layer(name: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``mlp.experts``: the part after the layer's index."""
    parts = name.split(".")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[digits[-1] + 1 :]) if digits and digits[-1] + 1 < len(parts) else name


def reaches_experts(model, route: Routing, targets: Mapping[str, list[str]], existing=None) -> bool | None:
    """Whether a LoRA config with ``targets`` (added to the ``existing`` config's targets) puts tensors on the
    routed experts with the installed peft: tried on a copy of the model's architecture up to its first MoE
    layer, on the meta device (no weights). None when the copy cannot be built or peft refuses the config."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    base = base_model(model)
    config = _truncated_config(base, route)
    if config is None:
        return None
    modules = targets.get("target_modules", [])
    existing_modules = getattr(existing, "target_modules", None)
    if isinstance(existing_modules, (set, frozenset, list, tuple)):
        modules = sorted({*existing_modules, *modules})
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            clone = type(base)(config)
            lora = LoraConfig(
                r=8, target_modules=modules or None, target_parameters=targets.get("target_parameters")
            )
            adapted = get_peft_model(clone, lora)
    except Exception:  # peft or the architecture refused the trial: say nothing rather than guess
        return None
    clone_route = routing(adapted)
    reach = model_reach(adapted, clone_route) if clone_route is not None else None
    return reach is not None and reach.on_experts > 0


def _truncated_config(base, route: Routing):
    """A copy of ``base``'s config with the layers cut after its first MoE layer (and the per-layer lists
    with them); the full config when the layer index cannot be read."""
    config = copy.deepcopy(getattr(base, "config", None))
    if config is None:
        return None
    match = re.search(r"\.(\d+)\.", f".{route.routers[0]}.")
    layers = getattr(config, "num_hidden_layers", None)
    if match and isinstance(layers, int) and int(match.group(1)) + 1 < layers:
        keep = int(match.group(1)) + 1
        for key, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == layers:
                setattr(config, key, value[:keep])
        config.num_hidden_layers = keep
    return config


# -- the load-balancing term of the training loss ---------------------------------------------------------
def aux_term(trainer, model, returned: Any = "unknown") -> dict[str, Any] | None:
    """Whether the loss the trainer computes carries the router's load-balancing term, as plain facts: who adds
    it (``decided_by``: a TRL trainer decides at init, `aux_loss_enabled`; otherwise the model adds it to its own
    loss when its forward returns one), what the forward returned (``returned_aux``: its ``aux_loss``, None when
    it returned none; ``"unknown"`` when not measured), and the coefficient that weighs it (TRL's own, else the
    one the model was built with: the model reads ``router_aux_loss_coef`` from its config once, at init).
    None for a model without a router, or one whose architecture has no load-balancing loss."""
    route = routing(model)
    if route is None or not route.aux_capable:
        return None
    base = base_model(model)
    config = text_config(base)
    built = getattr(base, "router_aux_loss_coef", None)
    declared = getattr(config, "router_aux_loss_coef", None)
    facts: dict[str, Any] = {
        "model_class": route.model_class,
        "trainer_class": type(trainer).__name__ if trainer is not None else None,
        "output_router_logits": bool(getattr(config, "output_router_logits", False)),
        "config_coefficient": as_number(declared),
        "returned_aux": returned if isinstance(returned, str) else as_number(returned),
    }
    if trainer is not None and hasattr(trainer, "aux_loss_enabled"):  # TRL: SFT, DPO, KTO, GRPO, RLOO, ...
        # The coefficient as each TRL keeps it: `router_aux_loss_coef` on the trainer (TRL 1.16, from its config or
        # the model's), in its config (TRL 1.9: a number, written into the model config), `aux_loss_coef` (TRL
        # 0.x's preference trainers, read from the model config), else none: TRL 0.x's SFTTrainer leaves the loss
        # to the model's forward, which weighs it by the coefficient it was built with.
        args = getattr(trainer, "args", None)
        if hasattr(trainer, "router_aux_loss_coef"):
            coefficient = as_number(trainer.router_aux_loss_coef)
        elif getattr(args, "router_aux_loss_coef", None) is not None:
            coefficient = as_number(args.router_aux_loss_coef)
        elif hasattr(trainer, "aux_loss_coef"):
            coefficient = as_number(trainer.aux_loss_coef)
        else:
            coefficient = as_number(built if built is not None else declared)
        # TRL 1.x turns `aux_loss_enabled` off for a coefficient of 0; TRL 0.x sets it from output_router_logits
        # alone, and then adds the loss weighed by 0.
        enabled = bool(trainer.aux_loss_enabled) and coefficient != 0.0
        facts.update(decided_by="trainer", enabled=enabled, coefficient=coefficient)
        # Where the user sets that coefficient: the trainer's config (TRL 1.x), else the model config.
        facts["coefficient_set_in"] = (
            "trainer-config" if hasattr(args, "router_aux_loss_coef") else "model-config"
        )
    else:
        facts.update(decided_by="model", coefficient=as_number(built if built is not None else declared))
        if not isinstance(returned, str):
            facts["enabled"] = returned is not None and bool(facts["coefficient"])
    return facts


def as_number(value) -> float | None:
    """A number or a tensor (its mean) as a float; None for None or what is not a number."""
    if value is None:
        return None
    try:
        return float(value.detach().float().mean()) if hasattr(value, "detach") else float(value)
    except (TypeError, ValueError):
        return None


def returned_aux(output) -> Any:
    """The ``aux_loss`` a forward returned (None when it returned none)."""
    aux = getattr(output, "aux_loss", None)
    if aux is None and isinstance(output, Mapping):
        aux = output.get("aux_loss")
    return aux


# -- how one forward's tokens spread over the experts -----------------------------------------------------
@dataclass
class Load:
    """Per MoE layer (router names in ``layers``), the share of experts no token went to and the busiest
    expert's load over the ideal (every expert with an equal share), on device until read; ``assignments``:
    (token, expert) assignments of a layer (tokens times top-k)."""

    layers: list[str]
    dead: list[Any]
    peak: list[Any]
    assignments: Any
    experts: int

    def plain(self) -> dict[str, Any]:
        """As numbers (one transfer of a few floats per layer)."""
        return {
            "layers": list(self.layers),
            "dead": [float(v) for v in self.dead],
            "peak": [float(v) for v in self.peak],
            "ideal": float(self.assignments) / self.experts if self.experts else 0.0,
            "experts": self.experts,
        }


@contextlib.contextmanager
def routed(routers: Routers, attention_mask=None, *, failed: list | None = None) -> Iterator[list[Load]]:
    """Count where ``routers`` send the tokens of the forwards run inside the block: yields a list that holds,
    after the block, one :class:`Load` (nothing when no router ran). Padding is not counted when
    ``attention_mask`` is given. No synchronisation: the counts stay on the device. With ``failed``, a count
    that fails inside the forward is appended there instead of failing the forward."""
    counts: dict[str, Any] = {}
    hooks = []

    def hook_for(name: str):
        def record(module, args, output) -> None:
            try:
                counts[name] = _expert_counts(
                    module, output, routers.output_index, routers.top_k, attention_mask
                )
            except Exception as exc:
                if failed is None:
                    raise
                failed.append(exc)

        return record

    for name, module in routers.modules:
        hooks.append(module.register_forward_hook(hook_for(name)))
    out: list[Load] = []
    try:
        yield out
    finally:
        for handle in hooks:
            handle.remove()
    measured = [(name, c) for name, _ in routers.modules if (c := counts.get(name)) is not None]
    if measured:
        out.append(_load(measured))


def _expert_counts(module, output, index: int, top_k: int | None, attention_mask):
    """Tokens per expert of one router call: from the expert indices the router returned (an integer tensor
    of (tokens, k)), else from the top-k of its logits."""
    import torch

    parts = output if isinstance(output, (tuple, list)) else (output,)
    logits = parts[index] if index < len(parts) else parts[0]
    experts = int(getattr(module, "num_experts", 0) or logits.shape[-1])
    chosen = next(
        (
            p
            for p in parts
            if isinstance(p, torch.Tensor) and not p.is_floating_point() and p.dim() == 2 and p is not logits
        ),
        None,
    )
    logits = logits.reshape(-1, logits.shape[-1])
    if chosen is None:
        k = int(getattr(module, "top_k", 0) or top_k or 1)
        chosen = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    chosen = chosen.reshape(logits.shape[0], -1)
    weights = torch.ones(chosen.shape, dtype=torch.float32, device=chosen.device)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.numel() == chosen.shape[0]:
        weights = weights * attention_mask.reshape(-1, 1).to(device=chosen.device, dtype=torch.float32)
    counts = torch.zeros(experts, dtype=torch.float32, device=chosen.device)
    return counts.scatter_add_(0, chosen.reshape(-1).long(), weights.reshape(-1))


def _load(measured: list[tuple[str, Any]]) -> Load:
    dead, peak = [], []
    experts = int(measured[0][1].numel())
    for _, counts in measured:
        total = counts.sum()
        dead.append((counts == 0).float().mean())
        peak.append(counts.max() * counts.numel() / total.clamp(min=1.0))
    return Load(
        layers=[name for name, _ in measured],
        dead=dead,
        peak=peak,
        assignments=measured[0][1].sum(),
        experts=experts,
    )
