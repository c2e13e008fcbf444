"""Whole-model CPU benchmark: random-weight Mamba-1 / Mamba-2 language models at the 130M and 370M shapes,
prefill and decode tokens/s, tvm_mamba against transformers' implementation and llama.cpp on the same weights.

    python scripts/bench_lm.py [--models mamba1-130m,mamba2-130m,mamba1-370m,mamba2-370m] [--prefill 256,1024]
        [--decode 128] [--batch 1,8] [--procs 3] [--weights fp32,bf16,int8] [--no-hf]
        [--llamacpp f32,q8_0 | --no-llamacpp] [--per-step] [--quick] [--json out.json]

Models (mamba_ssm's state-spaces configs, weights drawn locally with mamba_ssm's init, nothing downloaded):
``mamba{1,2}-130m`` d_model 768, 24 layers; ``mamba{1,2}-370m`` d_model 1024, 48 layers; vocab 50280; Mamba-1
layers d_state 16, expand 2, d_conv 4; Mamba-2 layers d_state 128, headdim 64, ngroups 1, chunk_size 256.
``mamba{1,2}-tiny`` (2 layers, d_model 128, vocab 512) are the --quick models.

Phases. prefill L: one forward over a (batch, L) prompt filling the decode states (tokens/s = batch * L / time).
decode N: after an 8-token prompt (prefilled, untimed), N greedy steps, each one forward of (batch, 1) tokens
through the model's own decode path (ours: ``inference_params`` with ``seqlen_offset``; transformers': its
``cache``), the argmax fed back (tokens/s = batch * N / time). With --per-step each step is timed on its own
and a process's figure is its median step time times N (case "decode N tok (median step)"): a step that a
busy machine's scheduler delays moves a whole run's time but not the median step.

Every measurement (model, implementation, batch, phase) runs in a fresh process (``--child``), ``--procs`` of
them per cell, interleaved between the implementations; inside one, one untimed warm-up run (kernel builds /
loads) then ``ITERS`` timed runs (fewer, at least one, past ``CHILD_BUDGET_S``), their median; the table gives
the median over the processes. Before timing a model, one more process loads the same weights into
transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` (``checkpoint.config_to_hf`` / ``state_dict_to_hf``)
and compares the logits of a prefill and of 4 decode steps with ours: max |diff| is printed, and the run stops
(exit 1) above ``CHECK_RTOL`` relative to max |logit|.
transformers is optional (``--no-hf``, or not installed: no comparison column).
--weights: ours with fp32 weights and/or ``tvm_mamba.quantize_weights(model, "bfloat16" | "int8")`` (weight-only
projections and LM head, docs/linear.md); rows of a quantized model say so in their shape ("... int8"), and
are compared with transformers at fp32. The logits check runs on the fp32 model.

llama.cpp (``pip install 'tvm-mamba[llamacpp]'``: llama-cpp-python, which compiles llama.cpp, and gguf; skipped
with ``--no-llamacpp`` or when not installed): one more process per model writes the model as GGUF files
(``tvm_mamba.modules.gguf.save_gguf``, one per ``--llamacpp`` weight type: f32, q8_0) in a temporary directory
and checks llama.cpp's f32 logits against ours like transformers' (q8_0's difference is printed, not
checked); llama.cpp then runs each phase in its own fresh processes through llama.h (scripts/_llamacpp.py),
``n_threads`` = tvm_mamba's thread count, batch b as b sequences of one context.
Each reference gets its own row (same case and shape, tvm_mamba's figures repeated, ``ref_name`` "transformers
(torch path)", "llama.cpp f32" or "llama.cpp q8_0"); a cell with no reference gets one row without.

--json PATH: scripts/bench.py's schema 1 (op "lm", case "prefill 256 tok" / "decode 128 tok", shape
"mamba2-130m b=1", ref_name "transformers (torch path)" or "" without it; ref_s / ref_over_tvm null then),
each row with extra fields at the end: tvm_tok_s, ref_tok_s, tvm_runs_s, ref_runs_s (per-process medians);
top level: "machine" (cpu, arch, cores, torch_threads, tvm_num_threads), "checks" (per model max_abs_diff,
rel_diff; "llamacpp": the same per weight type), "procs", "impls", "llama_cpp" (llama-cpp-python's version).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from benchlib import Row, format_table, write_json  # noqa: E402

_M1 = dict(layer="Mamba1", d_state=16, expand=2, d_conv=4)
_M2 = dict(layer="Mamba2", d_state=128, headdim=64, ngroups=1, chunk_size=256, expand=2, d_conv=4)
# name -> (ssm_cfg, d_model, n_layer, vocab_size)
MODELS = {
    "mamba1-130m": (_M1, 768, 24, 50280), "mamba2-130m": (_M2, 768, 24, 50280),
    "mamba1-370m": (_M1, 1024, 48, 50280), "mamba2-370m": (_M2, 1024, 48, 50280),
    "mamba1-tiny": (_M1, 128, 2, 512), "mamba2-tiny": (_M2, 128, 2, 512),
}
DEFAULTS = dict(models="mamba1-130m,mamba2-130m,mamba1-370m,mamba2-370m", prefill="256,1024", decode="128",
                batch="1,8", procs=3, weights="fp32", llamacpp="f32,q8_0")
QUICK = dict(models="mamba1-tiny,mamba2-tiny", prefill="32", decode="8", batch="1", procs=1, weights="fp32",
             llamacpp="f32")
WEIGHTS = {"fp32": None, "bf16": "bfloat16", "int8": "int8"}  # --weights -> quantize_weights dtype
ITERS, QUICK_ITERS = 3, 2   # timed runs per process
DECODE_PROMPT = 8           # prompt tokens before the timed decode steps
WARMUP_STEPS = 4            # decode steps of the warm-up run (the first step loads the decode kernels)
CHILD_BUDGET_S = 20.0       # no further timed runs in a process once its timed runs took this long
CHECK_RTOL = 1e-3           # max |ours - transformers| / max |transformers| allowed on the logits
HF_NAME = "transformers (torch path)"
LLAMA_IMPL = "llamacpp-"    # + weight type: the impl name of llama.cpp on that GGUF file; its ref_name below
LLAMA_NAME = "llama.cpp {}"
LLAMA_QTYPES = ("f32", "q8_0")  # tvm_mamba.modules.gguf.QTYPES, named here so the parent need not import torch
RESULT_TAG = "BENCH_LM_RESULT "
SOFTWARE: dict = {}         # the parent's record of what its children ran (versions, target, torch threads)


# ------------------------------------------------------------------------------------------------------------
# inside a child process: build the model(s), time one phase
def build_models(name: str, hf: bool, weights: str = "fp32"):
    """-> (ours, transformers' model or None): the same random weights (seed 0, mamba_ssm's init), float32;
    ours then quantized by ``quantize_weights`` unless ``weights`` is fp32."""
    import torch

    from tvm_mamba.modules import checkpoint
    from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

    ssm_cfg, d_model, n_layer, vocab = MODELS[name]
    torch.manual_seed(0)
    ours = MambaLMHeadModel(MambaConfig(d_model=d_model, n_layer=n_layer, vocab_size=vocab,
                                        ssm_cfg=dict(ssm_cfg))).eval()
    if not hf:
        return _quantized(ours, weights), None
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = checkpoint.config_to_hf(ours)
    cls = transformers.MambaForCausalLM if cfg["model_type"] == "mamba" else transformers.Mamba2ForCausalLM
    ref = cls(transformers.AutoConfig.for_model(**cfg))
    ref.load_state_dict(checkpoint.state_dict_to_hf(ours.state_dict()), strict=True)
    return _quantized(ours, weights), ref.eval()


def _quantized(model, weights: str):
    from tvm_mamba import quantize_weights

    return model if WEIGHTS[weights] is None else quantize_weights(model, WEIGHTS[weights])


class Runner:
    """One implementation's prefill / decode calls. ours: inference_params; transformers: its cache."""

    def __init__(self, model, impl: str):
        self.model, self.impl = model, impl

    def prefill(self, ids):
        """ids (b, L) -> (last-token logits (b, vocab), state to continue from)."""
        if self.impl == "hf":
            out = self.model(ids, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1], out.cache
        from tvm_mamba.modules.lm import InferenceParams

        params = InferenceParams(max_seqlen=ids.shape[1] + 1024, max_batch_size=ids.shape[0])
        params.key_value_memory_dict = self.model.allocate_inference_cache(ids.shape[0], params.max_seqlen)
        logits = self.model(ids, inference_params=params, num_last_tokens=1).logits
        params.seqlen_offset = ids.shape[1]
        return logits[:, -1], params

    def step(self, tok, state):
        """tok (b, 1) -> next-token logits (b, vocab); the state advances one token."""
        if self.impl == "hf":
            return self.model(tok, cache=state, use_cache=True).logits[:, -1]
        logits = self.model(tok, inference_params=state, num_last_tokens=1).logits[:, -1]
        state.seqlen_offset += 1
        return logits

    def decode(self, logits, state, n: int, steps: list | None = None):
        """n greedy steps from logits (b, vocab) (each step's argmax is the next input) -> the last logits;
        ``steps``: a list each step's seconds are appended to (argmax included)."""
        for _ in range(n):
            t0 = time.perf_counter()
            logits = self.step(logits.argmax(dim=-1, keepdim=True), state)
            if steps is not None:
                steps.append(time.perf_counter() - t0)
        return logits


class LlamaRunner(Runner):
    """llama.cpp on the GGUF file of the same weights (scripts/_llamacpp.py): batch b is b sequences of one
    context; n_threads is torch's thread count, the OpenMP team tvm_mamba's kernels run on by default. The
    greedy loop stays in numpy (a torch argmax could wake torch's own threads between llama.cpp's steps);
    logits come back as torch tensors like the other runners'."""

    def __init__(self, path: str, batch: int, max_tokens: int):
        import torch
        from _llamacpp import LlamaCpp

        super().__init__(LlamaCpp(path, n_threads=torch.get_num_threads(), n_seq=batch, max_tokens=max_tokens),
                         "llamacpp")

    def prefill(self, ids):
        import torch

        self.model.reset()
        return torch.from_numpy(self.model.forward(ids.numpy())), None

    def step(self, tok, state):
        import torch

        return torch.from_numpy(self.model.forward(tok.numpy()))

    def decode(self, logits, state, n: int, steps: list | None = None):
        import torch

        logits = logits.numpy()
        for _ in range(n):
            t0 = time.perf_counter()
            logits = self.model.forward(logits.argmax(axis=-1)[:, None])
            if steps is not None:
                steps.append(time.perf_counter() - t0)
        return torch.from_numpy(logits)


def _ids(batch: int, length: int, vocab: int, seed: int):
    import torch

    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def time_phase(runner: Runner, phase: str, batch: int, tokens: int, vocab: int, iters: int,
               steps: list | None = None) -> list[float]:
    """Seconds of each timed run of the phase, after one untimed warm-up (a decode warm-up takes WARMUP_STEPS
    steps): `iters` runs, fewer (at least one) once the timed runs add up to CHILD_BUDGET_S. ``steps``: a list
    every timed decode step's seconds are appended to."""
    import torch

    times: list[float] = []
    with torch.inference_mode():
        for i in range(iters + 1):
            if i and sum(times) >= CHILD_BUDGET_S:
                break
            if phase == "prefill":
                ids = _ids(batch, tokens, vocab, seed=i)
                t0 = time.perf_counter()
                runner.prefill(ids)
            else:
                logits, state = runner.prefill(_ids(batch, DECODE_PROMPT, vocab, seed=i))
                t0 = time.perf_counter()
                runner.decode(logits, state, tokens if i else min(tokens, WARMUP_STEPS), steps if i else None)
            if i:
                times.append(time.perf_counter() - t0)
    return times


CHECK_BATCH, CHECK_LEN, CHECK_STEPS = 2, 64, 4  # the logits checks' prompt and decode steps


def _ours_logits(ours, name: str) -> tuple[list, list]:
    """ours on the check prompt (batch CHECK_BATCH, CHECK_LEN tokens) then CHECK_STEPS greedy steps ->
    (logits of the prefill and of each step, the tokens fed)."""
    import torch

    with torch.inference_mode():
        runner = Runner(ours, "tvm")
        logits, state = runner.prefill(_ids(CHECK_BATCH, CHECK_LEN, MODELS[name][3], seed=123))
        got, tokens = [logits], []
        for _ in range(CHECK_STEPS):
            tokens.append(got[-1].argmax(dim=-1, keepdim=True))
            got.append(runner.step(tokens[-1], state))
    return got, tokens


def _compare(got: list, tokens: list, ref: Runner, name: str) -> dict:
    """ref fed the same prompt and tokens as ours (_ours_logits) -> max |ours - ref| over every logit."""
    import torch

    with torch.inference_mode():
        logits, state = ref.prefill(_ids(CHECK_BATCH, CHECK_LEN, MODELS[name][3], seed=123))
        want = [logits] + [ref.step(tok, state) for tok in tokens]
    diff = max(float((g - w).abs().max()) for g, w in zip(got, want))
    scale = max(float(w.abs().max()) for w in want)
    return dict(max_abs_diff=diff, rel_diff=diff / scale, max_abs_logit=scale, steps=len(tokens))


def check_logits(name: str) -> dict:
    """ours vs transformers on the same weights: a prefill (batch 2, 64 tokens), then 4 decode steps fed the
    same tokens (ours' greedy choices)."""
    ours, ref = build_models(name, hf=True)
    return _compare(*_ours_logits(ours, name), Runner(ref, "hf"), name)


def export_and_check_llamacpp(name: str, directory: str, qtypes: list[str]) -> dict:
    """Write the model as one GGUF file per weight type in directory (gguf_path), then ours vs llama.cpp on
    each, as check_logits -> {qtype: check}."""
    from tvm_mamba.modules.gguf import save_gguf

    ours, _ = build_models(name, hf=False)
    got, tokens = _ours_logits(ours, name)
    checks = {}
    for qtype in qtypes:
        path = save_gguf(ours, gguf_path(directory, name, qtype), qtype=qtype, name=name)
        ref = LlamaRunner(str(path), CHECK_BATCH, CHECK_BATCH * CHECK_LEN)
        checks[qtype] = _compare(got, tokens, ref, name)
        ref.model.close()
    return checks


def gguf_path(directory: str, name: str, qtype: str) -> str:
    return os.path.join(directory, f"{name}-{qtype}.gguf")


def software(hf: bool, llamacpp: bool = False) -> dict:
    """Versions, the TVM target and torch's thread count, as this process sees them."""
    import torch

    import tvm_mamba
    from tvm_mamba.runtime import target_for_device

    out = dict(tvm_mamba=tvm_mamba.__version__, torch=torch.__version__, target=str(target_for_device("cpu")),
               torch_threads=torch.get_num_threads(), tvm_num_threads=os.environ.get("TVM_NUM_THREADS"))
    if hf:
        import transformers

        out["transformers"] = transformers.__version__
    if llamacpp:
        from _llamacpp import version

        out["llama_cpp"] = version()
    return out


def child(spec: dict) -> dict:
    if spec["phase"] == "check":
        return dict(check_logits(spec["model"]), software=software(hf=True))
    if spec["phase"] == "export":
        return dict(llamacpp=export_and_check_llamacpp(spec["model"], spec["dir"], spec["qtypes"]),
                    software=software(hf=False, llamacpp=True))
    if spec["impl"].startswith(LLAMA_IMPL):  # llama.cpp's runs do not build our model at all
        path = gguf_path(spec["dir"], spec["model"], spec["impl"][len(LLAMA_IMPL):])
        runner = LlamaRunner(path, spec["batch"], spec["batch"] * max(spec["tokens"], DECODE_PROMPT))
    else:
        ours, ref = build_models(spec["model"], hf=spec["impl"] == "hf", weights=spec.get("weights", "fp32"))
        runner = Runner(ref if spec["impl"] == "hf" else ours, spec["impl"])
        del ours, ref  # the runner's model only (transformers' runs do not hold our copy of the weights)
    steps: list[float] = []
    times = time_phase(runner, spec["phase"], spec["batch"], spec["tokens"], MODELS[spec["model"]][3],
                       spec["iters"], steps)
    per_step = spec.get("per_step") and spec["phase"] == "decode"
    return dict(seconds=statistics.median(steps) * spec["tokens"] if per_step else statistics.median(times),
                runs=times,
                software=software(hf=spec["impl"] == "hf", llamacpp=spec["impl"].startswith(LLAMA_IMPL)))


# ------------------------------------------------------------------------------------------------------------
# the parent: one fresh process per measurement
def run_child(spec: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"bench_lm child {spec} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def machine() -> dict:
    """The CPU model (/proc/cpuinfo's model name, else platform), its architecture, logical cores."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return dict(cpu=cpu or platform.processor() or platform.machine(), arch=platform.machine(), cores=os.cpu_count())


@dataclasses.dataclass
class LMRow(Row):
    tokens: int = 0                                 # tokens per timed call (batch * L or batch * N)
    tvm_runs: list = dataclasses.field(default_factory=list)   # per-process medians, seconds
    ref_runs: list = dataclasses.field(default_factory=list)

    def record(self) -> dict:
        rec = super().record()
        rec.update(tvm_tok_s=self.tokens / (self.tvm_ms * 1e-3),
                   ref_tok_s=None if self.ref_ms is None else self.tokens / (self.ref_ms * 1e-3),
                   tvm_runs_s=self.tvm_runs, ref_runs_s=self.ref_runs)
        return rec


def ref_name(impl: str) -> str:
    return HF_NAME if impl == "hf" else LLAMA_NAME.format(impl[len(LLAMA_IMPL):])


def measure(model: str, phase: str, tokens: int, batch: int, impls: list[str], procs: int, iters: int,
            gguf_dir: str | None = None, weights: str = "fp32", per_step: bool = False) -> list[LMRow]:
    """procs fresh processes per implementation (interleaved) -> one row of medians per reference
    implementation (tvm_mamba's figures in each), or one row without a reference. ``weights``: ours';
    ``per_step``: a decode cell's process figure is its median step time x the steps (see --per-step)."""
    runs = {impl: [] for impl in impls}
    for _ in range(procs):
        for impl in impls:
            spec = dict(model=model, impl=impl, phase=phase, batch=batch, tokens=tokens, iters=iters, dir=gguf_dir,
                        weights=weights, per_step=per_step)
            result = run_child(spec)
            runs[impl].append(result["seconds"])
            SOFTWARE.update(result["software"])
    tvm_ms = 1e3 * statistics.median(runs["tvm"])
    n = batch * tokens
    shape = f"{model} b={batch}" + ("" if weights == "fp32" else f" {weights}")
    rows, case = [], f"{phase} {tokens} tok" + (" (median step)" if per_step and phase == "decode" else "")
    for ref in [impl for impl in impls if impl != "tvm"] or [None]:
        ref_ms = 1e3 * statistics.median(runs[ref]) if ref else None
        note = f"{n / tvm_ms * 1e3:,.1f} tok/s" + (f" vs {n / ref_ms * 1e3:,.1f} tok/s" if ref_ms else "")
        rows.append(LMRow("lm", case, shape, tvm_ms, ref_ms,
                          ref_name=ref_name(ref) if ref else "", note=note, tokens=n, tvm_runs=runs["tvm"],
                          ref_runs=runs[ref] if ref else []))
    return rows


def _ints(text: str, what: str, least: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise SystemExit(f"bench_lm.py: --{what} must be a comma-separated list of ints >= {least}, got {text!r}")
    return values


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default {DEFAULTS['models']})")
    ap.add_argument("--prefill", help=f"prompt lengths (default {DEFAULTS['prefill']}; '0': no prefill rows)")
    ap.add_argument("--decode", help=f"decode steps (default {DEFAULTS['decode']}; '0': no decode rows)")
    ap.add_argument("--batch", help=f"batch sizes (default {DEFAULTS['batch']})")
    ap.add_argument("--procs", type=int, help=f"fresh processes per cell (default {DEFAULTS['procs']})")
    ap.add_argument("--weights", help=f"ours' weights, comma-separated of {', '.join(WEIGHTS)} (default fp32)")
    ap.add_argument("--no-hf", action="store_true", help="no transformers comparison")
    ap.add_argument("--per-step", action="store_true",
                    help="decode: each process's figure is its median step time x the steps, not the median run")
    ap.add_argument("--llamacpp", help="llama.cpp weight types, of f32, q8_0 (default "
                    f"{DEFAULTS['llamacpp']}; --quick: {QUICK['llamacpp']}) when llama-cpp-python is installed")
    ap.add_argument("--no-llamacpp", action="store_true", help="no llama.cpp comparison")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + " ".join(f"--{k} {v}" for k, v in QUICK.items()) + " unless given")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the machine as JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _hf_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def _llamacpp_qtypes(args) -> list[str]:
    """The --llamacpp weight types to compare, [] with --no-llamacpp or without llama-cpp-python / gguf."""
    from _llamacpp import available

    qtypes = [q for q in args.llamacpp.split(",") if q]
    if not qtypes or not set(qtypes) <= set(LLAMA_QTYPES):
        raise SystemExit(f"bench_lm.py: --llamacpp must be a comma-separated list of {', '.join(LLAMA_QTYPES)}, "
                         f"got {args.llamacpp!r}")
    return [] if args.no_llamacpp or not available() else qtypes


def run_all(args) -> tuple[list[LMRow], dict]:
    """Every (model, phase, batch) row, a logits check per model first when transformers runs."""
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise SystemExit(f"bench_lm.py: unknown model {', '.join(unknown) or '(none)'}; valid: {', '.join(MODELS)}")
    if args.procs < 1:
        raise SystemExit("bench_lm.py: --procs must be >= 1")
    phases = [("prefill", n) for n in _ints(args.prefill, "prefill", 0) if n] + \
             [("decode", n) for n in _ints(args.decode, "decode", 0) if n]
    batches = _ints(args.batch, "batch")
    weights = [w for w in args.weights.split(",") if w]
    if not weights or any(w not in WEIGHTS for w in weights):
        raise SystemExit(f"bench_lm.py: --weights must be a comma-separated list of {', '.join(WEIGHTS)}, "
                         f"got {args.weights!r}")
    qtypes = _llamacpp_qtypes(args)
    impls = ["tvm"] + (["hf"] if not args.no_hf and _hf_available() else []) + [LLAMA_IMPL + q for q in qtypes]
    iters = QUICK_ITERS if args.quick else ITERS
    rows, checks = [], {}
    with (tempfile.TemporaryDirectory(prefix="bench_lm_gguf_") if qtypes else contextlib.nullcontext()) as gguf_dir:
        for model in models:
            if "hf" in impls:
                checks[model] = c = run_child(dict(model=model, phase="check"))
                SOFTWARE.update(c.pop("software", {}))
                _report_check(model, "transformers", c, gate=True)
            if qtypes:  # the GGUF files of this model (the previous model's are deleted: 0.5 GB each at 130M f32)
                for f in os.listdir(gguf_dir):
                    os.remove(os.path.join(gguf_dir, f))
                c = run_child(dict(model=model, phase="export", dir=gguf_dir, qtypes=qtypes))
                SOFTWARE.update(c.pop("software", {}))
                checks.setdefault(model, {})["llamacpp"] = c["llamacpp"]
                for qtype, check in c["llamacpp"].items():
                    _report_check(model, LLAMA_NAME.format(qtype), check, gate=qtype == "f32")
            for w, (phase, tokens) in ((w, p) for w in weights for p in phases):
                for batch in batches:
                    rows += measure(model, phase, tokens, batch, impls, args.procs, iters, gguf_dir, w,
                                    args.per_step)
                    for row in rows[-(len(impls) - 1 or 1):]:
                        print(f"  {row.case} ({row.shape}) vs {row.ref_name or '-'}: {row.note}", flush=True)
    return rows, dict(checks=checks, impls=impls)


def _report_check(model: str, ref: str, c: dict, gate: bool) -> None:
    """Print a logits check; with gate, stop (SystemExit) when ours and ref disagree beyond CHECK_RTOL."""
    print(f"logits check {model} vs {ref}: max |diff| {c['max_abs_diff']:.3g} (rel {c['rel_diff']:.3g} of max "
          f"|logit| {c['max_abs_logit']:.3g}; prefill + {c['steps']} decode steps)", flush=True)
    if gate and not c["rel_diff"] <= CHECK_RTOL:
        raise SystemExit(f"bench_lm.py: {model}: ours and {ref} disagree (rel {c['rel_diff']:.3g} > "
                         f"{CHECK_RTOL}); not timing")


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        print(RESULT_TAG + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    mach = machine()
    print(f"bench_lm: {mach['cpu']} ({mach['arch']}), {mach['cores']} logical cores; median of {args.procs} "
          "fresh process(es) per cell", flush=True)
    rows, extra = run_all(args)
    sw = dict(SOFTWARE)
    print(f"tvm_mamba {sw.get('tvm_mamba')}, torch {sw.get('torch')} ({sw.get('torch_threads')} threads, "
          f"TVM_NUM_THREADS {sw.get('tvm_num_threads')}), transformers {sw.get('transformers', '-')}, "
          f"llama-cpp-python {sw.get('llama_cpp', '-')}; target {sw.get('target')}")
    print(format_table(rows))
    if args.json:
        meta = {"tvm_mamba": sw.get("tvm_mamba"), "torch": sw.get("torch"), "transformers": sw.get("transformers"),
                "llama_cpp": sw.get("llama_cpp"),
                "target": sw.get("target"), "threads": sw.get("torch_threads"), "quick": args.quick, "ops": ["lm"],
                "machine": dict(mach, torch_threads=sw.get("torch_threads"), tvm_num_threads=sw.get("tvm_num_threads")), "procs": args.procs, **extra}
        write_json(args.json, rows, meta)
    return 0


def run(quick: bool = False) -> list[Row]:
    """scripts/bench.py's entry: the --quick set, or the full default set (long: fresh processes per cell)."""
    return run_all(parse(["--quick"] if quick else []))[0]


if __name__ == "__main__":
    sys.exit(main())
