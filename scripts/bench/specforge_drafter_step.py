#!/usr/bin/env python3
"""Peer baseline of `dflash bench drafter --baseline specforge`: SpecForge 0.2.0's OWN DFlash
drafter training step, timed at the shapes of our bench, in a process of its own.

What runs (all SpecForge code, unmodified, from the installed `specforge==0.2.0` wheel):
  TrainerCore.train_step(batch) = DFlashTrainStrategy.forward_loss -> OnlineDFlashModel.forward
  (its anchor sampling, its DFlash block mask, DFlashDraftModel, its lm_head + CE objective in
  chunks of --objective-chunk-blocks blocks under non-reentrant checkpointing) ->
  FSDPTrainingBackend.backward -> gradients divided by the loss denominator -> BF16Optimizer.step
  (grad-norm clip, AdamW on fp32 master weights, warmup + cosine LR, copy back to the model dtype).
The pieces are assembled as `specforge train` assembles them on one GPU: the draft config is
generated from a target config.json (Qwen3, written to a temp dir) by SpecForge's
resolve_draft_config; weights are random (SpecForge's own init); the batch is one random
document of --context tokens, every token supervised, already on the device.

SpecForge's defaults kept: --attention flex_attention (transformers' compiled flex_attention with
SpecForge's BlockMask), model dtype bfloat16 with fp32 master AdamW, objective_chunk_blocks 128,
FSDP (torchrun world size 1, init_distributed) around the draft model. Two device rules, both
explicit flags set by the caller and echoed in the JSON: flex_attention has no backward on CPU in
torch 2.11 (the CPU test passes --attention sdpa, SpecForge's dense-mask backend), and FSDP refuses
CPU tensors (--wrap none on CPU).

Objective: SpecForge 0.2.0's DFlash objective is hard-label CE with exp(-(k-1)/gamma) position
weights; it has NO soft-label (KL) term. --soft-labels is therefore refused here (exit 2); the
caller reports the objective mismatch.

Only SpecForge's DFlash modules are imported. Third-party modules they import but this path never
calls are replaced by stubs when missing (named in "stubbed_modules" when there are any; calling one
raises). "specforge_modules" lists the SpecForge modules the measured step was built from, as
imported (sys.modules), so the JSON shows which code ran.

Output: one JSON object on stdout (median_step_s, tokens_per_s, peak_gib, settings); progress on
stderr. Exit: 0 measured; 1 the step failed; 2 bad usage or SpecForge not usable
("SpecForgeUnavailable: ..." on stderr: not installed, not importable, or not version 0.2.0).
"""
import argparse
import importlib
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import types

SPECFORGE_VERSION = "0.2.0"
# Imported by modules on the DFlash path at import time, never called by the training step.
OPTIONAL_MODULES = {"huggingface_hub": ["snapshot_download", "hf_hub_download"], "safetensors": ["safe_open"]}


class SpecForgeUnavailable(Exception):
    """SpecForge 0.2.0 cannot be imported (exit 2)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("layers", 5), ("hidden", 4096), ("heads", 32), ("kv-heads", 8), ("head-dim", 128),
                          ("intermediate", 12288), ("vocab", 151936), ("context-layers", 5),
                          ("target-layers", 36), ("context", 4096), ("anchors", 512), ("block-size", 16),
                          ("objective-chunk-blocks", 128), ("warmup", 2), ("repeats", 5), ("seed", 1)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--gamma", type=float, default=7.0, help="loss_decay_gamma (position weights)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--attention", default="flex_attention", choices=["flex_attention", "sdpa"])
    p.add_argument("--wrap", default="fsdp", choices=["fsdp", "none"])
    p.add_argument("--soft-labels", action="store_true", help="refused: SpecForge's DFlash loss has no KL")
    a = p.parse_args(argv)
    for name in ["layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "context_layers",
                 "target_layers", "context", "anchors", "block_size", "objective_chunk_blocks", "repeats", "warmup"]:
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(a, name)}")
    if a.block_size < 2:
        p.error(f"--block-size: expected >= 2, got {a.block_size}")
    if a.soft_labels:
        p.error("--soft-labels: SpecForge 0.2.0's DFlash objective is hard-label CE only (no KL term)")
    if a.device.startswith("cpu") and (a.attention == "flex_attention" or a.wrap == "fsdp"):
        p.error("--device cpu needs --attention sdpa --wrap none (torch has no flex_attention backward on CPU "
                "and FSDP refuses CPU tensors)")
    return a


def stub_missing_optional():
    """Stubs for OPTIONAL_MODULES that are not installed; returns their names."""
    def unavailable(qualname):
        def call(*args, **kwargs):
            raise RuntimeError(f"{qualname}: stubbed by the bench (package not installed), must not be called")
        return call

    stubbed = []
    for mod, attrs in OPTIONAL_MODULES.items():
        if importlib.util.find_spec(mod) is None:
            m = types.ModuleType(mod)
            for attr in attrs:
                setattr(m, attr, unavailable(f"{mod}.{attr}"))
            sys.modules[mod] = m
            stubbed.append(mod)
    return stubbed


def import_specforge():
    """The SpecForge modules of the DFlash training path, as a namespace; SpecForgeUnavailable if the
    wheel is missing, broken or not 0.2.0."""
    from importlib import metadata
    try:
        importlib.import_module("specforge")
        version = metadata.version("specforge")
    except (ImportError, metadata.PackageNotFoundError) as e:
        raise SpecForgeUnavailable(f"specforge is not installed ({type(e).__name__}: {e}); "
                                   f"pip install --no-deps specforge=={SPECFORGE_VERSION}") from e
    if version != SPECFORGE_VERSION:
        raise SpecForgeUnavailable(f"specforge {version} is installed; this baseline is specforge=={SPECFORGE_VERSION}")
    names = {
        "specforge.modeling.draft": [],  # registers the drafts (and sets dynamo's recompile limit) as a run does
        "specforge.algorithms.common.dflash_family_model": ["OnlineDFlashModel"],
        "specforge.algorithms.common.providers": ["DraftConfigProvider", "TargetDerivedDraftDefaults"],
        "specforge.algorithms.model_providers": ["apply_dflash_overrides", "populate_dflash_generated_config"],
        "specforge.distributed": ["init_distributed", "destroy_distributed"],
        "specforge.modeling.auto": ["AutoDraftModel"],
        "specforge.modeling.draft.dflash": ["build_target_layer_ids"],
        "specforge.modeling.target.target_utils": ["TargetEmbeddingsAndHead"],
        "specforge.optimizer": ["BF16Optimizer"],
        "specforge.runtime.contracts": ["TrainBatch"],
        "specforge.training.backend": ["FSDPTrainingBackend", "ParallelConfig"],
        "specforge.training.controller": ["TrainerCore"],
        "specforge.training.model_loading": ["resolve_draft_config"],
        "specforge.training.model_utils": ["resolve_mask_token_id"],
        "specforge.training.strategies.base": ["DFlashTrainStrategy", "StepContext"],
    }
    sf = types.SimpleNamespace(version=version)
    for module, attrs in names.items():
        try:
            m = importlib.import_module(module)
        except Exception as e:  # a broken or partial install
            raise SpecForgeUnavailable(f"cannot import {module}: {type(e).__name__}: {e}") from e
        for attr in attrs:
            if not hasattr(m, attr):
                raise SpecForgeUnavailable(f"{module} has no {attr} (not the {SPECFORGE_VERSION} API)")
            setattr(sf, attr, getattr(m, attr))
    return sf


def torchrun_env(device):
    """The environment torchrun gives `specforge train` on one GPU (world size 1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    index = device.split(":")[1] if ":" in device else "0"
    for k, v in {"RANK": "0", "LOCAL_RANK": index, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(k, v)
    os.environ["SPECFORGE_DEVICE"] = device.split(":")[0]


def draft_config(a, sf, transformers, target_dir):
    """SpecForge's generated DFlash draft config for a Qwen3 target of our bench's shape."""
    target = transformers.Qwen3Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.target_layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, attention_bias=False)
    target.save_pretrained(target_dir)
    ns = types.SimpleNamespace
    run = ns(mode="offline",
             model=ns(target_model_path=target_dir, draft_model_config=None, draft_checkpoint_path=None,
                      cache_dir=None, trust_remote_code=False, draft_num_hidden_layers=a.layers,
                      draft_block_size=a.block_size, mask_token_id=None, torch_dtype=a.dtype,
                      use_liger_kernel=False),
             training=ns(strategy="dflash", attention_backend=a.attention, num_anchors=a.anchors,
                         loss_decay_gamma=a.gamma, objective_chunk_blocks=a.objective_chunk_blocks,
                         loss_type="dflash", dpace_alpha=0.5))
    provider = sf.DraftConfigProvider(
        architecture="DFlashDraftModel", expected_auto_map_model="dflash.DFlashDraftModel",
        target_defaults=sf.TargetDerivedDraftDefaults(model_type="qwen3", num_hidden_layers=1,
                                                      populate=sf.populate_dflash_generated_config),
        apply_overrides=sf.apply_dflash_overrides)
    cfg = sf.resolve_draft_config(run, provider=provider)
    # Our drafter reads K = --context-layers captured layers; SpecForge derives K from the layer count.
    if len(cfg.dflash_config["target_layer_ids"]) != a.context_layers:
        cfg.dflash_config["target_layer_ids"] = sf.build_target_layer_ids(a.target_layers, a.context_layers)
    cfg._attn_implementation = a.attention
    return target, cfg


def build_step(a, sf, torch, transformers, device, dtype, target_dir):
    """TrainerCore over SpecForge's model, backend and optimizer; returns (core, parts for the report)."""
    target_cfg, cfg = draft_config(a, sf, transformers, target_dir)
    with torch.device(device):  # SpecForge builds on CPU and moves; same init, faster setup
        draft = sf.AutoDraftModel.from_config(cfg, torch_dtype=dtype, dflash_kernels=None)
        frozen = sf.TargetEmbeddingsAndHead(target_cfg)
    draft = draft.to(device=device, dtype=dtype)
    mask_id = sf.resolve_mask_token_id(explicit=a.vocab - 1, tokenizer=None, draft_model=draft,
                                       embedding_vocab_size=int(draft.config.vocab_size))
    draft.mask_token_id = mask_id
    draft.config.dflash_config["mask_token_id"] = mask_id
    frozen.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model = sf.OnlineDFlashModel(
        draft_model=draft, target_lm_head=frozen.lm_head, target_embed_tokens=frozen.embed_tokens,
        mask_token_id=mask_id, block_size=int(draft.block_size), attention_backend=a.attention,
        num_anchors=a.anchors, loss_decay_gamma=a.gamma, objective_chunk_blocks=a.objective_chunk_blocks,
        loss_type="dflash").to(device=device, dtype=dtype)
    parallel = sf.ParallelConfig.from_distributed(tp_size=1, sp_ulysses_size=1, sp_ring_size=1)
    parallel.param_dtype = dtype  # SpecForge's FSDP mixed precision is bf16; fp32 only in CPU tests
    backend = sf.FSDPTrainingBackend(parallel, optimizer_factory=lambda module: sf.BF16Optimizer(
        module, lr=a.lr, max_grad_norm=a.max_grad_norm, warmup_ratio=0.015, lr_scheduler="cosine",
        total_steps=100000, offload_master=False))
    wrapped = backend.prepare_model(model, wrap=a.wrap == "fsdp", optimizer_target=model.draft_model)
    strategy = sf.DFlashTrainStrategy(wrapped)
    strategy.trainable_module().train()
    core = sf.TrainerCore(strategy, backend, accumulation_steps=1)
    return core, draft, backend


def host_peak_reset():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        return True
    except OSError:
        return False


def host_peak_gib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2 ** 20
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(a, sf, torch, core, device, dtype):
    """Median seconds of TrainerCore.train_step over --repeats after --warmup, and the peak memory
    of the timed steps."""
    g = torch.Generator().manual_seed(a.seed)
    K, S = a.context_layers, a.context
    batch = sf.TrainBatch(sample_ids=["bench"], strategy="dflash", tensors={
        "input_ids": torch.randint(0, a.vocab - 1, (1, S), generator=g).to(device),
        "hidden_states": torch.randn((1, S, K * a.hidden), generator=g).to(device=device, dtype=dtype),
        "loss_mask": torch.ones((1, S), dtype=torch.long, device=device)})
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    times, losses, host_reset = [], [], False
    for i in range(a.warmup + a.repeats):
        if i == a.warmup:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            else:
                host_reset = host_peak_reset()
        sync()
        t0 = time.perf_counter()
        res = core.train_step(batch, ctx=sf.StepContext(global_step=i, total_steps=100000))
        sync()
        dt = time.perf_counter() - t0
        if not res.optimizer_stepped:
            raise RuntimeError("TrainerCore.train_step did not step the optimizer (accumulation_steps=1)")
        losses.append(res.loss)
        if i >= a.warmup:
            times.append(dt)
        print(f"[specforge step {i}{' warmup' if i < a.warmup else ''}] {dt * 1e3:.1f} ms loss {res.loss:.4f}",
              file=sys.stderr, flush=True)
    if cuda:
        peak, reserved = torch.cuda.max_memory_allocated(device) / 2 ** 30, torch.cuda.max_memory_reserved(device) / 2 ** 30
        source = "CUDA caching allocator (allocated / reserved bytes)"
    else:
        peak = reserved = host_peak_gib()
        source = "host VmHWM" + (" (reset after warm-up)" if host_reset else " (whole process)")
    med = statistics.median(times)
    return {"median_step_s": med, "median_step_ms": med * 1e3, "tokens_per_s": S / med,
            "step_s": times, "peak_gib": peak, "peak_reserved_gib": reserved, "memory_source": source,
            "loss_first": losses[0], "loss_last": losses[-1]}


def main(argv=None):
    a = parse_args(argv)
    stubbed = stub_missing_optional()
    is_cuda = a.device.startswith("cuda")
    if a.wrap == "fsdp":
        torchrun_env(a.device)
    else:
        os.environ["SPECFORGE_DEVICE"] = a.device.split(":")[0]
    import torch
    import transformers
    try:
        sf = import_specforge()
    except SpecForgeUnavailable as e:
        print(f"SpecForgeUnavailable: {e}", file=sys.stderr)
        return 2
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if is_cuda:
        if device.index is None:  # torch.cuda.set_device and FSDP need an indexed device
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.manual_seed(a.seed)
    if a.wrap == "fsdp":
        sf.init_distributed(timeout=10, tp_size=1, sp_ulysses_size=1, sp_ring_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="sf_target_") as target_dir:
            core, draft, backend = build_step(a, sf, torch, transformers, device, dtype, target_dir)
            result = measure(a, sf, torch, core, device, dtype)
        trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        wrapper = backend._wrapper_kind
    finally:
        if a.wrap == "fsdp":
            sf.destroy_distributed()
    result.update({
        "bench": "specforge", "specforge_version": sf.version, "device": a.device,
        "timed_unit": "specforge.training.controller.TrainerCore.train_step",
        "context": a.context, "anchors": a.anchors, "block_size": a.block_size, "layers": a.layers,
        "hidden": a.hidden, "vocab": a.vocab, "context_layers": a.context_layers, "trainable_params": trainable,
        "warmup": a.warmup, "repeats": a.repeats,
        "settings": {"attention": a.attention, "dtype": a.dtype, "master_weights": "fp32 (BF16Optimizer)",
                     "wrap": wrapper, "objective": "dflash (hard-label CE, exp(-(k-1)/gamma) weights)",
                     "gamma": a.gamma, "objective_chunk_blocks": a.objective_chunk_blocks,
                     "objective_checkpointing": True, "soft_labels": False,
                     "fc_in_features": int(draft.fc.in_features),
                     "target_layer_ids": list(draft.target_layer_ids)},
        "specforge_modules": sorted(m for m in sys.modules if m == "specforge" or m.startswith("specforge.")),
        "torch": torch.__version__, "transformers": transformers.__version__})
    if stubbed:
        result["stubbed_modules"] = stubbed
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
