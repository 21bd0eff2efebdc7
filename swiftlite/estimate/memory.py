"""Training memory from a model's config.json alone: model states per ZeRO stage and offload
option, and activations with and without gradient checkpointing.

Parameter counts are exact: the model is built on PyTorch's "meta" device from its config
(no weights, no memory) and its tensors are counted, which also gives the LoRA adapter size
for the chosen target modules. Model states for full fine-tuning follow DeepSpeed's own
estimators (tests/e2e/test_estimate.py checks them against
estimate_zero{2,3}_model_states_mem_needs_all_cold); they are generalised here to a frozen
base with trainable adapters. Activations count the tensors a Qwen2/Llama decoder layer keeps
for backward (see activation_bytes_per_token). docs/estimate.md gives the measured error.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from swiftlite.config.constants import LOSS_CHUNK_ROWS as LOSS_CHUNK
from swiftlite.config.constants import STAGES as STAGE_DESCRIPTIONS
from swiftlite.config.sizes import gib
from swiftlite.errors import UsageError
from swiftlite.models.meta import meta_model


# DeepSpeed's estimators pad CPU-side figures by 1.5 for pinned buffers and fragmentation.
CPU_BUFFER_FACTOR = 1.5
# Share of a GPU's memory that training may plan to use: the rest is the CUDA context,
# allocator fragmentation and short-lived buffers.
USABLE_FRACTION = 0.9
# Fastest first (Hugging Face's DeepSpeed guide: DDP > ZeRO-1 > ZeRO-2 > ZeRO-2 offload >
# ZeRO-3 > ZeRO-3 offload).
STAGES = tuple(STAGE_DESCRIPTIONS)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_params: int  # tied embeddings counted once
    trainable_params: int
    largest_layer_params: int  # biggest single module (what ZeRO-3 gathers at once)
    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    attn_dim: int  # num_attention_heads * head_dim
    lora_inputs_per_layer: int  # sum of in_features of the adapted linears of one layer
    linear_outputs_per_layer: int = 0  # sum of out_features of all linears of one layer
    linear_params: int = 0  # weights of every nn.Linear but the LM head (what QLoRA quantizes)
    largest_linear_params: int = 0  # one linear weight (dequantized at a time under QLoRA)
    dora_outputs_per_layer: int = 0  # --use_dora: sum of out_features of one layer's adapted linears


@dataclass
class Row:
    """One configuration. Bytes per GPU (per training process) and per node's CPU memory."""
    stage: str
    gpu: dict = field(default_factory=dict)  # params, grads, optim, activations, ...
    cpu: dict = field(default_factory=dict)
    gpu_total: int = 0  # with gradient checkpointing
    gpu_total_no_ckpt: int = 0
    cpu_total: int = 0


def model_spec(name: str, config: dict, train_type: str = "lora", lora_rank: int = 8,
               target_modules=("all-linear",), use_dora: bool = False,
               modules_to_save=()) -> ModelSpec:
    """Exact counts from the architecture built on the meta device (no memory used). DoRA
    adds a trained magnitude per output row of each adapted linear; --modules_to_save trains
    a full copy of each module named (the frozen original stays)."""
    import torch

    from swiftlite.models.targets import check_target_modules, peft_target, saved
    hf_config, model = meta_model(name, config)
    target_modules = peft_target(target_modules)
    if train_type != "full":
        check_target_modules(model, target_modules)
    unique = {id(p): p.numel() for p in model.parameters()}
    total = sum(unique.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    lora, per_layer_inputs, outputs = _lora_counts(model, lora_rank, target_modules)
    copies = sum({id(p): p.numel() for n, m in model.named_modules()  # tied: one copy (peft's
                  if n and saved(n, modules_to_save)  # ensure_weight_tying, as tuners sets)
                  for p in m.parameters()}.values())
    if use_dora:
        lora += outputs[0]
    total, lora = total + copies, lora + copies
    layer0 = [m for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and ".layers.0." in f"{n}."]
    head = model.get_output_embeddings()
    linears = [m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head]
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelSpec(name=name, total_params=total,
                     trainable_params=total if train_type == "full" else lora,
                     largest_layer_params=largest, hidden_size=text.hidden_size,
                     num_layers=text.num_hidden_layers,
                     intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
                     attn_dim=heads * head_dim, lora_inputs_per_layer=per_layer_inputs,
                     linear_outputs_per_layer=sum(m.out_features for m in layer0),
                     linear_params=sum(linears), largest_linear_params=max(linears, default=0),
                     dora_outputs_per_layer=outputs[1] if use_dora else 0)


def quantized_bytes_per_weight(bits: int, double_quant: bool = True) -> float:
    """bitsandbytes' storage per weight: 4-bit weights in blocks of 64 with an fp32 scale each
    (4.5 bits), or with double quantization 8-bit scales plus one fp32 per 256 blocks (about
    4.127 bits); 8-bit (LLM.int8): one byte and an fp32 scale per output row (counted as
    1 byte: rows are thousands of weights long)."""
    if bits == 8:
        return 1.0
    scales = (8 / 64 + 32 / (64 * 256)) if double_quant else 32 / 64
    return (4 + scales) / 8


def _lora_counts(model, rank: int, targets) -> tuple[int, int, tuple[int, int]]:
    """(adapter parameters, adapted input features in one decoder layer, adapted output
    features (in all, in one decoder layer)), the way peft picks
    modules: "all-linear" is every nn.Linear except the output layer; otherwise a target
    matches a module's full name or its ending after a dot (q_proj, self_attn.q_proj), an
    embedding (embed_tokens) or the output layer (lm_head) included."""
    import torch

    from swiftlite.models.targets import is_all_linear
    out_layer = model.get_output_embeddings()
    all_linear = is_all_linear(targets)
    if isinstance(targets, str) and not all_linear:
        import re  # a single string is a regex over full module names, as in peft
        pattern = targets
        targets = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    params, first_layer_inputs, first_layer, outputs, first_outputs = 0, 0, None, 0, 0
    for name, module in model.named_modules():
        if all_linear:
            if not isinstance(module, torch.nn.Linear) or module is out_layer:
                continue
        elif not (isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and
                  any(name == t or name.endswith("." + t) for t in targets)):
            continue
        if isinstance(module, torch.nn.Embedding):  # A: r x vocab, B: dim x r; no activations
            params += rank * (module.num_embeddings + module.embedding_dim)
            continue
        params += rank * (module.in_features + module.out_features)
        outputs += module.out_features
        layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
        first_layer = first_layer if first_layer is not None else layer
        if layer == first_layer:
            first_layer_inputs += module.in_features
            first_outputs += module.out_features
    return params, first_layer_inputs, (outputs, first_outputs)


def activation_bytes_per_token(spec: ModelSpec, dtype: str, train_type: str,
                               lora_dropout: float = 0.05) -> dict:
    """Bytes kept for backward per token: one decoder layer, the loss, and the checkpointed
    input of one layer. Counted from what autograd saves in a Qwen2/Llama layer:
    - each RMSNorm saves its fp32 input (4h), plus its 16-bit output when the norm weight is
      trained (full fine-tuning);
    - attention saves the normed input, q, the head-repeated k and v, the SDPA output and
      o_proj's input (h + 5 x heads*head_dim values); SDPA/flash keep no seq x seq matrix;
    - the SwiGLU MLP saves the normed input, gate, silu(gate), up and their product
      (h + 4 x intermediate values);
    - LoRA: peft runs each adapter in fp32 on its own dropout of the input (4 bytes + a
      1-byte mask per input feature of every adapted linear); DoRA also keeps the base and
      adapter outputs for its magnitude's gradient (2 x 4 bytes per adapted output feature);
    - --selective_checkpointing (LoRA) keeps, with each checkpointed layer input, the output of
      every frozen matmul of the layer, as torch's policy does on GPUs (CPU fused LoRA layers
      keep all but the last, so this is an upper bound there); full fine-tuning has none;
    - the model's own loss (--chunked_loss false, and always under ZeRO-3): the logits are
      upcast to fp32 and log_softmax's output is kept; its backward holds that output, the
      incoming gradient and the result: 12 bytes x vocab per token;
    - swiftlite's chunked loss (training/speedups/chunked_loss.py): one chunk of logits whose
      fp32 log-probabilities and softmax are computed in place (4 bytes x vocab x chunk rows),
      or for a 16-bit head the logits with an fp32 copy (6 bytes), a copy of the head's
      weight that the gradient's matmul packs (CPU BLAS: measured on tiny-qwen2), and
      per token the gathered hidden state with its gradient; full fine-tuning adds the LM
      head's fp32 weight gradient (4 bytes x vocab x hidden), accumulated over the chunks.
    """
    a = DTYPE_BYTES[dtype]
    h, i = spec.hidden_size, spec.intermediate_size
    full = train_type == "full"
    norms = 2 * (4 * h + (a * h if full else 0))
    attention = a * (h + 5 * spec.attn_dim)
    mlp = a * (h + 4 * i)
    lora = 0 if full else (spec.lora_inputs_per_layer * (4 + (1 if lora_dropout > 0 else 0))
                           + 8 * spec.dora_outputs_per_layer)
    return {"layer": norms + attention + mlp + lora, "checkpoint": a * h,
            "selective": 0 if full else a * spec.linear_outputs_per_layer,
            "loss": 12 * spec.vocab_size, "chunked_loss": 2 * a * h,
            "loss_chunk": (4 if a == 4 else a + 4) * LOSS_CHUNK * spec.vocab_size,
            "loss_head_workspace": a * spec.vocab_size * h,
            "loss_weight_grad": 4 * spec.vocab_size * h if full else 0}


def activations(spec: ModelSpec, tokens: int, dtype: str, train_type: str,
                checkpointing: bool, lora_dropout: float = 0.05, chunked_loss: bool = True,
                selective: bool = False) -> int:
    """Peak activation bytes of one micro-batch of `tokens` tokens. Without checkpointing all
    layers' activations are alive when the loss is computed and backpropagated; with it, only
    each layer's input (and with `selective` its frozen matmul outputs) is kept, and one layer
    is recomputed (with its gradients) at a time."""
    per = activation_bytes_per_token(spec, dtype, train_type, lora_dropout)
    if chunked_loss:
        loss = (per["loss_chunk"] * min(1.0, tokens / LOSS_CHUNK) + tokens * per["chunked_loss"]
                + per["loss_head_workspace"] + per["loss_weight_grad"])
    else:
        loss = tokens * per["loss"]
    kept = spec.num_layers * (per["layer"] if not checkpointing else
                              per["checkpoint"] + (per["selective"] if selective else 0))
    recompute = 0 if not checkpointing else per["layer"] + 2 * per["checkpoint"]
    return int(tokens * kept + max(loss, tokens * recompute))


def model_states(stage: str, total: int, trainable: int, largest_layer: int, *,
                 gpus_per_node: int = 1, nodes: int = 1, weight_bytes: int = 2,
                 load_bytes: int = 4, zero_init: bool = False,
                 buffer_factor: float = CPU_BUFFER_FACTOR) -> tuple[dict, dict]:
    """(per-GPU bytes, per-node CPU bytes) of parameters, gradients and optimizer states.

    DeepSpeed rows with trainable == total, weight_bytes=2, load_bytes=4 are DeepSpeed's own
    estimates (load_bytes: the copy each process loads into CPU memory before DeepSpeed takes
    the model). Trainable parameters carry 16-bit grads (w), fp32 grads (4), an fp32 master
    copy (4) and Adam's two moments (8); frozen ones only their 16-bit copy.
    "none" is the plain Trainer: weights, grads and AdamW states all in the weights' dtype,
    except LoRA adapters, which peft keeps in fp32.
    """
    n, w, pt, pf = gpus_per_node * nodes, weight_bytes, trainable, total - trainable
    load = load_bytes * total * gpus_per_node  # every local process loads the model first
    gpu = {"params": 0, "grads": 0, "optim": 0}
    cpu = {"load": 0, "offloaded": 0}
    if stage == "none":
        lora = trainable < total
        tw = 4 if lora else w  # bytes per trainable weight
        gpu.update(params=w * pf + tw * pt, grads=tw * pt, optim=2 * tw * pt)
        if n > 1:  # DDP keeps its own gradient buckets next to .grad
            gpu["grads"] += tw * pt
        cpu["load"] = load
    elif stage in ("zero0", "zero1", "zero2"):
        part = {"zero0": 1, "zero1": n, "zero2": n}[stage]
        grads16 = w * pt if stage != "zero2" else w * pt // n
        gpu.update(params=w * total, grads=grads16 + 4 * pt // part, optim=12 * pt // part)
        cpu["load"] = load
    elif stage == "zero2_offload":
        gpu.update(params=w * total)
        cpu["load"] = load_bytes * total * n if nodes == 1 else load
        cpu["offloaded"] = 16 * pt
    elif stage == "zero3":
        # DeepSpeed's 18 bytes per parameter: 16-bit param + fp32 grad, master and Adam
        # moments, all partitioned; 16-bit gradients only live in reduce buckets.
        gpu.update(params=w * total // n + 4 * largest_layer, grads=4 * pt // n,
                   optim=12 * pt // n)
        cpu["load"] = 4 * largest_layer * gpus_per_node if zero_init else load
    elif stage == "zero3_offload":
        gpu.update(params=4 * largest_layer)
        cpu["offloaded"] = (w * total + 16 * pt) // nodes
        if not zero_init:
            cpu["load"] = load
    else:
        raise UsageError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    # DeepSpeed counts the larger of loading and steady state, padded by the buffer factor.
    cpu_total = int(max(cpu["load"], cpu["offloaded"]) * buffer_factor)
    return gpu, {**cpu, "total": cpu_total}


def estimate(spec: ModelSpec, *, gpus_per_node: int = 1, nodes: int = 1,
             dtype: str = "bfloat16", train_type: str = "lora", max_length: int = 2048,
             batch_size: int = 1, lora_dropout: float = 0.05,
             chunked_loss: bool = True, selective_checkpointing: bool = False,
             quant_bits: int | None = None, double_quant: bool = True,
             zero3: bool = True) -> list[Row]:
    """One Row per stage in STAGES for this setup (tokens per micro-batch: batch x length).
    quant_bits (QLoRA): the frozen linear weights at bitsandbytes' size, one of them
    dequantized at a time; no ZeRO-3 rows (it cannot partition packed weights), nor with
    `zero3` false (LoRA variants that need whole base weights: DoRA, PiSSA, OLoRA)."""
    from swiftlite.runtime.hardware import weights_dtype
    w = DTYPE_BYTES[weights_dtype(dtype, train_type)]
    tokens = batch_size * max_length
    saved = 0 if quant_bits is None else int(
        spec.linear_params * (w - quantized_bytes_per_weight(quant_bits, double_quant))
        - w * spec.largest_linear_params)
    rows = []
    for stage in STAGES:
        if (quant_bits is not None or not zero3) and stage.startswith("zero3"):
            continue
        # ZeRO-3 partitions the LM head, so swiftlite falls back to the model's own loss there.
        chunked = chunked_loss and not stage.startswith("zero3")
        act = activations(spec, tokens, dtype, train_type, True, lora_dropout, chunked,
                          selective_checkpointing)
        act_full = activations(spec, tokens, dtype, train_type, False, lora_dropout, chunked)
        # DeepSpeed trains 16-bit copies with fp32 masters whatever the load dtype was.
        load_w = DTYPE_BYTES[weights_dtype(dtype, train_type, deepspeed=stage != "none")]
        ds_w = DTYPE_BYTES[dtype] if stage != "none" else load_w
        gpu, cpu = model_states(stage, spec.total_params, spec.trainable_params,
                                spec.largest_layer_params, gpus_per_node=gpus_per_node,
                                nodes=nodes, weight_bytes=ds_w, load_bytes=load_w)
        gpu["params"] -= saved
        states = gpu["params"] + gpu["grads"] + gpu["optim"]
        rows.append(Row(stage, {**gpu, "activations": act, "activations_no_ckpt": act_full},
                        cpu, states + act, states + act_full, cpu["total"]))
    return rows


@dataclass
class Choice:
    deepspeed: str | None  # None: no DeepSpeed
    gradient_checkpointing: bool
    gpu_bytes: int
    cpu_bytes: int
    fits: bool
    reason: str
    quant_bits: int | None = None  # QLoRA: what fits when the 16-bit base does not

    def to_dict(self) -> dict:
        return asdict(self)


def recommend(rows: list[Row], gpu_memory: int, cpu_memory: int | None = None,
              gpus: int = 1) -> Choice:
    """The fastest configuration that fits: stages in STAGES order, each first without
    gradient checkpointing (faster) and then with it. Partitioning stages are skipped on one
    GPU (they partition nothing there)."""
    usable = int(gpu_memory * USABLE_FRACTION)
    for row in rows:
        if gpus == 1 and row.stage in ("zero0", "zero1", "zero2", "zero3"):
            continue
        if cpu_memory is not None and row.cpu_total > cpu_memory:
            continue
        for ckpt, need in ((False, row.gpu_total_no_ckpt), (True, row.gpu_total)):
            if need <= usable:
                ds = None if row.stage == "none" else row.stage
                why = (f"needs {gib(need)} of {gib(usable)} usable per GPU "
                       f"({int(USABLE_FRACTION * 100)}% of {gib(gpu_memory)})")
                return Choice(ds, ckpt, need, row.cpu_total, True, why)
    within_cpu = [r for r in rows if cpu_memory is None or r.cpu_total <= cpu_memory]
    smallest = min(within_cpu or rows, key=lambda r: r.gpu_total)
    ds = None if smallest.stage == "none" else smallest.stage
    return Choice(ds, True, smallest.gpu_total, smallest.cpu_total, False,
                  f"nothing fits: the smallest ({smallest.stage} with gradient checkpointing) "
                  f"needs {gib(smallest.gpu_total)} per GPU, {gib(usable)} usable. Lower "
                  "--max_length or --batch_size, use --train_type lora, or more GPUs.")
