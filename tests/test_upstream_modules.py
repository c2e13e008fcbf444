"""mamba_ssm 2.3.2.post1's own module code (modules/mamba_simple.py, modules/mamba2.py, modules/block.py,
models/mixer_seq_simple.py, utils/generation.py), imported from upstream's sdist with its kernel imports
aliased to tvm_mamba by ``tvm_mamba.compat.install(upstream=...)``, on the CPU (no triton, no CUDA extension):
it trains a step and generates, equal to tvm_mamba's own modules loaded (strictly) with the same weights, and
upstream's decode loop drives tvm_mamba's model. Upstream's own test_generation_varlen_with_padding
(tests/test_generation.py) runs too, CPU-sized.

Upstream's sources are read at test time from $TVM_MAMBA_UPSTREAM_DIR (a folder holding
``mamba_ssm-2.3.2.post1/`` or ``mamba_ssm-2.3.2.post1.tar.gz``); the tests skip without it. No upstream
code is part of this repository."""
from __future__ import annotations

import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tvm_mamba
from tests.modules._util import assert_rel_close
from tvm_mamba import compat
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel

SDIST = "mamba_ssm-2.3.2.post1"
UPSTREAM_TEST = "tests/test_generation.py"  # run by test_upstream_varlen_generation_with_padding_passes
VOCAB = 50  # padded to 56
M2 = dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=8)  # tests/modules' configs: the same kernels
M1 = dict(layer="Mamba1", d_state=8)


def _upstream_source(tmp_path_factory) -> Path:
    root = os.environ.get("TVM_MAMBA_UPSTREAM_DIR")
    if not root:
        pytest.skip("TVM_MAMBA_UPSTREAM_DIR is not set (a folder holding mamba_ssm-2.3.2.post1/ or its .tar.gz)")
    folder = Path(root) / SDIST
    if (folder / "mamba_ssm" / "__init__.py").is_file():
        return folder
    archive = Path(root) / f"{SDIST}.tar.gz"
    if not archive.is_file():
        pytest.skip(f"neither {folder} nor {archive} exists")
    out = tmp_path_factory.mktemp("upstream")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and (m.name.startswith(f"{SDIST}/mamba_ssm/")
                                                                   or m.name == f"{SDIST}/{UPSTREAM_TEST}")]
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse links and absolute paths
            tar.extractall(out, members=members, filter="data")
        else:  # members are plain files under the sdist's own folder (selected above)
            tar.extractall(out, members=members)
    return out / SDIST


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    pytest.importorskip("einops")
    pytest.importorskip("transformers")  # upstream's utils/generation.py and utils/hf.py import it
    src = _upstream_source(tmp_path_factory)
    compat.install(upstream=src)
    try:
        import mamba_ssm.models.config_mamba as config_mamba
        import mamba_ssm.models.mixer_seq_simple as mixer_seq_simple
        import mamba_ssm.utils.generation as generation
        yield SimpleNamespace(src=src, config_mamba=config_mamba, lm=mixer_seq_simple, generation=generation)
    finally:
        compat.uninstall()


def test_upstream_files_run_with_tvm_mamba_kernels(upstream):
    import mamba_ssm.modules.block as block
    import mamba_ssm.modules.mamba2 as mamba2
    import mamba_ssm.modules.mamba_simple as mamba_simple

    for module in (mamba_simple, mamba2, block, upstream.lm, upstream.generation):
        assert Path(module.__file__).is_relative_to(upstream.src), module.__file__  # upstream's own file
    assert mamba2.mamba_chunk_scan_combined is tvm_mamba.mamba_chunk_scan_combined
    assert mamba2.mamba_split_conv1d_scan_combined is tvm_mamba.mamba_split_conv1d_scan_combined
    assert mamba2.causal_conv1d_fn is tvm_mamba.causal_conv1d_fn
    assert mamba2.selective_state_update is tvm_mamba.selective_state_update
    assert mamba_simple.selective_scan_fn is tvm_mamba.selective_scan_fn
    assert mamba_simple.mamba_inner_fn is tvm_mamba.mamba_inner_fn
    import mamba_ssm

    assert mamba_ssm.Mamba2 is mamba2.Mamba2 and mamba_ssm.MambaLMHeadModel is upstream.lm.MambaLMHeadModel


class _UnrecordedEvent:
    """Stand-in for torch.cuda.Event on a CPU-only PyTorch build: upstream's decode() constructs two events
    (recorded only with enable_timing), which such a build refuses to instantiate."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing

    def record(self, stream=None):
        raise RuntimeError("enable_timing needs CUDA")


@pytest.fixture
def cpu_events(monkeypatch):
    try:
        torch.cuda.Event(enable_timing=False)
    except RuntimeError:  # "Tried to instantiate dummy base class Event"
        monkeypatch.setattr(torch.cuda, "Event", _UnrecordedEvent)


def _pair(upstream, ssm_cfg, fused_add_norm=True, rms_norm=True, d_intermediate=0, seed=0):
    """upstream's MambaLMHeadModel and ours with upstream's weights (strict load)."""
    kw = dict(d_model=32, n_layer=2, vocab_size=VOCAB, ssm_cfg=dict(ssm_cfg), fused_add_norm=fused_add_norm,
              rms_norm=rms_norm, d_intermediate=d_intermediate)
    torch.manual_seed(seed)
    theirs = upstream.lm.MambaLMHeadModel(upstream.config_mamba.MambaConfig(**kw))
    torch.manual_seed(seed)
    ours = MambaLMHeadModel(MambaConfig(**kw))
    want = theirs.state_dict()
    assert list(ours.state_dict()) == list(want)
    for name, value in ours.state_dict().items():  # same seed, same init (upstream's _init_weights order)
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():  # weights off their init values (norm weights 1, D 1, ...), then loaded into ours
        for p in theirs.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _ids(batch=2, seqlen=10, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


TRAIN_CASES = {  # upstream's fused paths (mamba_inner_fn, mamba_split_conv1d_scan_combined, layer_norm_fn)
    "Mamba1-fast-fused_add_norm": (dict(M1), True, True, 0),  # and its unfused ones (torch.nn.LayerNorm too)
    "Mamba1-slow": (dict(M1, use_fast_path=False), False, True, 0),
    "Mamba2-mem_eff-fused_add_norm": (dict(M2), True, True, 0),
    "Mamba2-unfused-LayerNorm": (dict(M2, use_mem_eff_path=False), False, False, 0),
    "Mamba2-fused_add_norm-LayerNorm": (dict(M2, use_mem_eff_path=False), True, False, 0),
    "Mamba2-GatedMLP": (dict(M2), True, True, 48),  # d_intermediate: norm2 + GatedMLP per block
    "Mamba2-GatedMLP-unfused": (dict(M2), False, True, 48),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_step_equals_ours(upstream, case):
    ssm_cfg, fused, rms, d_mlp = TRAIN_CASES[case]
    theirs, ours = _pair(upstream, ssm_cfg, fused_add_norm=fused, rms_norm=rms, d_intermediate=d_mlp)
    ids, tgt = _ids(seqlen=12), _ids(seqlen=12, seed=2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (theirs, ours)]
    for step in range(2):  # two steps: momentum carries the first step's gradient into the second
        logits = []
        for model, opt in zip((theirs, ours), opts):
            out = model(ids).logits
            opt.zero_grad()
            F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1)).backward()
            logits.append(out)
        assert_rel_close(logits[1], logits[0].double(), 1e-5, f"step {step} logits")
        want = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            assert_rel_close(p.grad, want[name].grad.double(), 1e-4, f"step {step} grad {name}")
        for opt in opts:
            opt.step()
    want = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_rel_close(p, want[name].double(), 1e-5, f"trained {name}")


@pytest.mark.parametrize("ssm_cfg", [M1, M2], ids=["Mamba1", "Mamba2"])
def test_generate_equals_ours(upstream, cpu_events, ssm_cfg):
    theirs, ours = _pair(upstream, ssm_cfg)
    prompt = _ids(seqlen=5)
    kw = dict(max_length=12, return_dict_in_generate=True, output_scores=True)
    want = theirs.generate(prompt, **kw)  # upstream's modules, upstream's GenerationMixin + decode
    got = ours.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences) and got.sequences.shape == (2, 12)
    assert len(got.scores) == len(want.scores) == 7 and got.scores[0].shape == (2, 56)  # padded vocabulary
    for i, (g, w) in enumerate(zip(got.scores, want.scores)):
        assert_rel_close(g, w.double(), 1e-5, f"score {i}")
    # upstream's decode loop drives our model; teacher forcing, repetition penalty, unpadded vocabulary
    teacher = _ids(seqlen=8, seed=5)
    dkw = dict(teacher_outputs=teacher, repetition_penalty=1.3, vocab_size=VOCAB, output_scores=True)
    want = upstream.generation.decode(prompt, theirs, 12, **dkw)
    got = upstream.generation.decode(prompt, ours, 12, **dkw)
    mine = ours.generate(prompt, 12, return_dict_in_generate=True, **dkw)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(mine.sequences, want.sequences)
    assert torch.equal(want.sequences[:, 5:8], teacher[:, 5:8])  # teacher tokens past the prompt
    for g, m, w in zip(got.scores, mine.scores, want.scores):
        assert g.shape == (2, VOCAB)
        assert_rel_close(g, w.double(), 1e-5, "decode(ours) score")
        assert_rel_close(m, w.double(), 1e-5, "ours.generate score")


def test_sampling_draws_as_upstream(upstream, cpu_events):
    """top-k / top-p / temperature sampling: upstream's sample() and ours consume the RNG alike."""
    _, ours = _pair(upstream, M2)
    prompt = _ids(seqlen=4)
    kw = dict(top_k=5, top_p=0.9, temperature=0.7, output_scores=True)
    torch.manual_seed(123)
    want = upstream.generation.decode(prompt, ours, 11, **kw)
    torch.manual_seed(123)
    got = ours.generate(prompt, 11, return_dict_in_generate=True, **kw)
    assert torch.equal(got.sequences, want.sequences)


def test_mamba2_varlen_prefill_equals_ours(upstream):
    """upstream's Mamba2.forward(u, seq_idx=, cu_seqlens=, inference_params=) (its varlen prefill through
    causal_conv1d_varlen_states and return_varlen_states), then a decode step, against ours."""
    import mamba_ssm.modules.mamba2 as mamba2

    from tvm_mamba.modules.generation import InferenceParams
    from tvm_mamba.modules.mamba2 import Mamba2

    torch.manual_seed(0)
    kw = dict(d_state=16, headdim=16, chunk_size=8, layer_idx=0)
    theirs = mamba2.Mamba2(32, **kw)
    ours = Mamba2(32, **kw)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    cu = torch.tensor([0, 5, 7, 16], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.diff(cu)).reshape(1, -1)
    u = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(3))
    tok = torch.randn(3, 1, 32, generator=torch.Generator().manual_seed(4))
    results = []
    with torch.no_grad():
        for model in (theirs, ours):
            params = upstream.generation.InferenceParams(max_seqlen=20, max_batch_size=3)
            out = model(u, seq_idx=seq_idx, cu_seqlens=cu, inference_params=params)
            conv_state, ssm_state = (s.clone() for s in params.key_value_memory_dict[0])
            params.seqlen_offset = 16
            results.append((out, conv_state, ssm_state, model(tok, inference_params=params)))
        mine = InferenceParams(max_seqlen=20, max_batch_size=3)  # ours, cu_seqlens alone (seq_idx derived)
        assert_rel_close(ours(u, cu_seqlens=cu, inference_params=mine), results[0][0].double(), 1e-5, "no seq_idx")
    for name, got, want in zip(("out", "conv_state", "ssm_state", "step"), results[1], results[0]):
        assert_rel_close(got, want.double(), 1e-5, name)


# upstream's test_generation.py needs CUDA (device, fp16, CUDA graphs) and a 1024-wide model: the lines that set
# them, each replaced once, so the rest of upstream's test (its sequence lengths, padding, loop and assertion)
# runs as written on the CPU, at the small Mamba2 config of the tests above
UPSTREAM_TEST_EDITS = [('device = "cuda"', 'device = "cpu"'), ("dtype = torch.float16", "dtype = torch.float32"),
                       ("d_model=1024", "d_model=32"), ("n_layer=4", "n_layer=2"),
                       ('ssm_cfg=dict(layer="Mamba2")', 'ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, '
                                                        'chunk_size=8)'), ("cg=True", "cg=False")]


@pytest.mark.parametrize("model", ["upstream", "ours"])
def test_upstream_varlen_generation_with_padding_passes(upstream, cpu_events, model):
    """mamba_ssm's own test_generation_varlen_with_padding (prompts packed with padding after the last one:
    cu_seqlens[-1] < seqlen), its body as upstream wrote it but for UPSTREAM_TEST_EDITS, on upstream's
    MambaLMHeadModel (our kernels underneath) and on ours (its MambaLMHeadModel, MambaConfig and
    InferenceParams in the test's namespace). ~10 s each."""
    path = upstream.src / UPSTREAM_TEST
    if not path.is_file():
        pytest.skip(f"{path} is not in the upstream source folder")
    source = path.read_text()
    for old, new in UPSTREAM_TEST_EDITS:
        assert old in source, f"upstream's {UPSTREAM_TEST} no longer has {old!r}"
        source = source.replace(old, new)
    ns = {"__name__": "upstream_test_generation"}
    exec(compile(source, str(path), "exec"), ns)
    if model == "ours":
        from tvm_mamba.modules.generation import InferenceParams

        ns.update(MambaLMHeadModel=MambaLMHeadModel, MambaConfig=MambaConfig, InferenceParams=InferenceParams)
    ns["test_generation_varlen_with_padding"]()
