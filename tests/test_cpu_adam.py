"""The fused CPU Adam kernel and CPUAdam/HybridAdam equal torch.optim.AdamW / Adam.

Every SIMD path this CPU runs is forced in turn (plus the torch fallback); the extension is
built once per session (``kernel`` fixture). Tolerances: fp32 values 1e-6 absolute on
N(0, 1) data; a parameter stored in fp16/bf16 within one unit in the last place.
"""
import pytest
import torch

from colossal_lite.nn.optimizer import CPUAdam, HybridAdam, adam_step, any_nonfinite
from colossal_lite.nn.optimizer import _kernel

# the first test pays the one JIT build of the extension (~30 s idle, minutes under load)
pytestmark = pytest.mark.timeout(900)

ATOL = 1e-6
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


@pytest.fixture(scope='session')
def kernel():
    ext = _kernel.load_extension()
    assert ext is not None, 'the C++ CPU Adam kernel did not build (see the warning)'
    return ext


SIMD_PATHS = ('scalar', 'avx2', 'avx512')


def _backends():
    """Forced paths: every SIMD path this CPU runs (asked of the built extension), then the
    torch implementation; all of them when the extension did not build (the ``kernel``
    fixture then fails each test, naming why)."""
    ext = _kernel.load_extension()
    return (list(ext.supported_simd()) if ext is not None else list(SIMD_PATHS)) + ['torch']


def pytest_generate_tests(metafunc):
    if 'backend' in metafunc.fixturenames:
        metafunc.parametrize('backend', _backends(), indirect=True)


@pytest.fixture
def backend(request, kernel):
    """The forced path of this test (parametrized by ``pytest_generate_tests``)."""
    return request.param


@pytest.mark.parametrize('path', SIMD_PATHS)
def test_forcing_a_simd_path_runs_it_or_names_the_cpu_refusal(kernel, path):
    """A path this CPU has runs when forced; one it lacks raises before touching a tensor."""
    p = torch.ones(3)
    args = (p, torch.ones(3), torch.zeros(3), torch.zeros(3), 1, LR, *BETAS, EPS, 0.0, True)
    if path in kernel.supported_simd():
        assert adam_step(*args, backend=path) is False           # finite: stepped
        assert torch.allclose(p, torch.full((3,), 1 - LR), atol=1e-6)   # Adam's first step
    else:
        with pytest.raises(ValueError, match='not supported by this CPU'):
            adam_step(*args, backend=path)
        assert torch.equal(p, torch.ones(3))


def _reference(master, grads, adamw, weight_decay, loss_scale, steps):
    """torch.optim.AdamW (adamw) or torch.optim.Adam (L2) on an fp32 copy, grads unscaled."""
    ref = master.clone().requires_grad_(True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    for g in grads[:steps]:
        ref.grad = g.float() * (1.0 / loss_scale)
        opt.step()
    state = opt.state[ref]
    return ref.detach(), state['exp_avg'], state['exp_avg_sq']


# (grad dtype, copy-out dtype, loss scale, adamw, weight decay)
CASES = [(torch.float32, None, 1.0, True, 0.1), (torch.float32, None, 1.0, False, 0.1),
         (torch.float16, torch.float16, 1024.0, True, 0.01),
         (torch.bfloat16, torch.bfloat16, 1024.0, True, 0.0),
         (torch.float16, None, 8.0, False, 0.05), (torch.bfloat16, torch.float16, 1.0, True, 0.1),
         (torch.float32, torch.bfloat16, 4.0, False, 0.0)]


@pytest.mark.parametrize('n', [1, 7, 33, 1000003])
@pytest.mark.parametrize('case', CASES,
                         ids=lambda c: '-'.join(str(x).replace('torch.', '') for x in c))
def test_fp32_master_equals_torch(backend, n, case):
    """fp32 master, fp32/fp16/bf16 grads, optional unscaling and copy-out, 3 steps."""
    grad_dtype, out_dtype, scale, adamw, wd = case
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * scale).to(grad_dtype) for _ in range(3)]
    ref, ref_m, ref_v = _reference(master, grads, adamw, wd, scale, 3)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
    for step, g in enumerate(grads, 1):
        found = adam_step(master, g, m, v, step, LR, *BETAS, EPS, wd, adamw, loss_scale=scale,
                          out_lowp=out, backend=backend)
        assert found is False
    torch.testing.assert_close(master, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(m, ref_m, atol=ATOL, rtol=0)
    torch.testing.assert_close(v, ref_v, atol=ATOL, rtol=0)
    if out is not None:  # the copy-out is the updated master, rounded as torch rounds
        assert torch.equal(out, master.to(out_dtype))


def _ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    mantissa = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    tiny = {torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}[dtype]
    return torch.clamp(x.abs() * 2.0 ** -mantissa, min=tiny)


@pytest.mark.parametrize('n', [1, 7, 33, 1000003])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_low_precision_params_equal_torch(backend, n, dtype):
    """A parameter stored in fp16/bf16 (no master): each step is AdamW in fp32 on its upcast
    value, rounded back: within one unit in the last place of the stored dtype plus the fp32
    tolerance (an element whose update cancels its value is ill-conditioned in fp32 already),
    moments fp32 to 1e-6."""
    gen = torch.Generator().manual_seed(n + 1)
    p = torch.randn(n, generator=gen).to(dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).to(dtype)
        ref = p.float().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1)
        opt.state[ref] = {'step': torch.tensor(float(step - 1)), 'exp_avg': m.clone(),
                          'exp_avg_sq': v.clone()}
        ref.grad = g.float()
        opt.step()
        assert adam_step(p, g, m, v, step, LR, *BETAS, EPS, 0.1, True, backend=backend) is False
        expected = ref.detach()
        assert ((p.float() - expected).abs() <= _ulp(expected, dtype) + ATOL).all()
        torch.testing.assert_close(m, opt.state[ref]['exp_avg'], atol=ATOL, rtol=0)
        torch.testing.assert_close(v, opt.state[ref]['exp_avg_sq'], atol=ATOL, rtol=0)


def test_paths_agree_on_tiny_tensors(kernel):
    """Every path gives the same result (1e-6) for each length 1..40 (all tails)."""
    for n in range(1, 41):
        gen = torch.Generator().manual_seed(100 + n)
        master, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).half()
        results = []
        for backend in _backends():
            p, m, v = master.clone(), torch.zeros(n), torch.zeros(n)
            out = torch.empty(n, dtype=torch.bfloat16)
            adam_step(p, g, m, v, 1, LR, *BETAS, EPS, 0.1, True, loss_scale=2.0, out_lowp=out,
                      backend=backend)
            results.append((p, m, v, out))
        for p, m, v, out in results[1:]:
            torch.testing.assert_close(p, results[0][0], atol=ATOL, rtol=0)
            torch.testing.assert_close(v, results[0][2], atol=ATOL, rtol=0)
            assert torch.equal(out, p.to(torch.bfloat16))


@pytest.mark.parametrize('bad', [float('inf'), float('-inf'), float('nan')])
@pytest.mark.parametrize('where', [0, 16, 1000002])
@pytest.mark.parametrize('grad_dtype', [torch.float32, torch.float16, torch.bfloat16])
def test_nonfinite_grad_skips_and_is_reported(backend, bad, where, grad_dtype):
    n = 1000003
    gen = torch.Generator().manual_seed(7)
    master = torch.randn(n, generator=gen)
    m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    out = torch.zeros(n, dtype=torch.float16)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    g[where] = bad
    before = [t.clone() for t in (master, m, v, out)]
    assert any_nonfinite(g, backend) is True
    assert adam_step(master, g, m, v, 3, LR, *BETAS, EPS, 0.1, True, loss_scale=4.0,
                     out_lowp=out, backend=backend) is True
    for t, b in zip((master, m, v, out), before):
        assert torch.equal(t, b), 'a skipped step wrote'
    g[where] = 0
    assert any_nonfinite(g, backend) is False


def _tiny_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))


def _train(model, opt, steps=5, loss_scale=None):
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(9, 7, generator=gen), torch.randn(9, 5, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if loss_scale is None:
            loss.backward()
            opt.step()
        else:
            (loss * loss_scale).backward()
            opt.step(loss_scale=loss_scale)


def _groups(model, lr, wd):
    w = [p for n, p in model.named_parameters() if n.endswith('weight')]
    b = [p for n, p in model.named_parameters() if n.endswith('bias')]
    return [dict(params=w, weight_decay=wd), dict(params=b, weight_decay=0.0, lr=lr * 3)]


@pytest.mark.parametrize('adamw', [True, False])
def test_hybrid_adam_is_a_drop_in_for_torch(backend, adamw):
    """A tiny MLP, two param groups (their own lr / weight decay), 5 steps."""
    ours_model, ref_model = _tiny_model(0), _tiny_model(0)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = ref_cls(_groups(ref_model, LR, 0.1), lr=LR, betas=BETAS, eps=EPS)
    ours = HybridAdam(_groups(ours_model, LR, 0.1), lr=LR, betas=BETAS, eps=EPS,
                      adamw_mode=adamw, backend=backend, check_finite=True)
    _train(ref_model, ref)
    _train(ours_model, ours, loss_scale=256.0)
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=name)
    assert int(ours.state[next(ours_model.parameters())]['step']) == 5


def test_optimizer_skips_the_whole_step_on_overflow(kernel):
    model = _tiny_model(1)
    opt = CPUAdam(model.parameters(), lr=LR, weight_decay=0.1, check_finite=True)
    _train(model, opt, steps=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model[2].bias.grad[1] = float('inf')  # only the last parameter overflows
    opt.step(loss_scale=128.0)
    assert opt.found_inf is True
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state_before[id(p)][k]), k
    model[2].bias.grad[1] = 0.0
    opt.step(loss_scale=128.0)
    assert opt.found_inf is False and int(opt.state[model[0].weight]['step']) == 3


def test_state_dict_round_trips_with_torch_adamw(kernel):
    """HybridAdam -> torch.optim.AdamW -> HybridAdam, training 2 steps on each side, equals
    AdamW throughout; the state keys are torch's."""
    ref_model, ours_model = _tiny_model(2), _tiny_model(2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.1)
    ours = HybridAdam(ours_model.parameters(), lr=LR, weight_decay=0.1)
    _train(ref_model, ref, steps=2)
    _train(ours_model, ours, steps=2)
    sd = ours.state_dict()
    keys = {'step', 'exp_avg', 'exp_avg_sq'}
    assert set(sd['state'][0]) == set(ref.state_dict()['state'][0]) == keys
    # ours -> torch: torch continues from our state
    handoff = _tiny_model(2)
    handoff.load_state_dict(ours_model.state_dict())
    torch_opt = torch.optim.AdamW(handoff.parameters(), lr=LR, weight_decay=0.1)
    torch_opt.load_state_dict(sd)
    _train(handoff, torch_opt, steps=2)
    _train(ref_model, ref, steps=2)
    for a, b in zip(handoff.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    # torch -> ours
    back = HybridAdam(handoff.parameters(), lr=LR, weight_decay=0.1)
    back.load_state_dict(torch_opt.state_dict())
    assert back.param_groups[0]['adamw_mode'] is True
    _train(handoff, back, steps=2)
    _train(ref_model, ref, steps=2)
    for a, b in zip(handoff.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert int(back.state[next(handoff.parameters())]['step']) == 6


def test_loaded_state_is_its_own_while_the_source_optimizer_lives_on(kernel):
    """HybridAdam loaded from a live torch.optim.AdamW's state dict owns its moments (torch
    hands out its own tensors): both then step side by side from the same weights and
    gradients and stay equal. Sharing, each step would update the moments twice (found on
    the H100: 1.1e-3 apart after one step)."""
    model = _tiny_model(2)
    source = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _train(model, source, steps=2)
    twin = _tiny_model(2)
    twin.load_state_dict(model.state_dict())
    ours = HybridAdam(twin.parameters(), lr=LR, weight_decay=0.1)
    ours.load_state_dict(source.state_dict())
    for p, q in zip(model.parameters(), twin.parameters()):
        for key in ('exp_avg', 'exp_avg_sq'):
            assert source.state[p][key].data_ptr() != ours.state[q][key].data_ptr(), key
    _train(model, source, steps=2)
    _train(twin, ours, steps=2)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_device_path_uses_torch_fused_adam(kernel):
    """The accelerator branch of HybridAdam (torch's fused Adam/AdamW, with the loss scale
    handed to it as grad_scale), run here on CPU tensors, equals torch.optim.AdamW."""
    ours_model, ref_model = _tiny_model(4), _tiny_model(4)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.1)
    ours = HybridAdam(ours_model.parameters(), lr=LR, weight_decay=0.1)
    _train(ref_model, ref, steps=3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(9, 7, generator=gen), torch.randn(9, 5, generator=gen)
        ours.zero_grad()
        (torch.nn.functional.mse_loss(ours_model(x), y) * 64.0).backward()
        ours._device_update(ours.param_groups[0], list(ours_model.parameters()), 64.0)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_backend_is_forced_by_environment(kernel, monkeypatch):
    for name in _backends():
        monkeypatch.setenv(_kernel.ENV_BACKEND, name)
        assert _kernel.active_backend() == name
    monkeypatch.setenv(_kernel.ENV_BACKEND, 'avx1024')
    with pytest.raises(ValueError, match="got 'avx1024'"):
        _kernel.active_backend()
    monkeypatch.delenv(_kernel.ENV_BACKEND)
    assert _kernel.active_backend() == kernel.best_simd()


def test_build_failure_falls_back_with_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match='could not be built'):
        assert _kernel.build_extension([str(tmp_path / 'missing.cpp')]) is None


def test_bad_operands_raise_before_writing(kernel):
    p, m, v = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    with pytest.raises(ValueError, match='grad has 4 elements, the parameter has 5'):
        adam_step(p, torch.zeros(4), m, v, 1, LR, *BETAS, EPS, 0.0, True)
    with pytest.raises(ValueError, match='exp_avg and exp_avg_sq must be float32'):
        adam_step(p, torch.zeros(5), m.half(), v, 1, LR, *BETAS, EPS, 0.0, True)
    with pytest.raises(ValueError, match='step must be >= 1'):
        adam_step(p, torch.zeros(5), m, v, 0, LR, *BETAS, EPS, 0.0, True, backend='torch')
    with pytest.raises(ValueError, match='step must be >= 1'):
        adam_step(p, torch.zeros(5), m, v, 0, LR, *BETAS, EPS, 0.0, True, backend='auto')
    with pytest.raises(NotImplementedError, match='amsgrad'):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], amsgrad=True)
    opt = CPUAdam([torch.nn.Parameter(torch.zeros(3))])
    opt.param_groups[0]['amsgrad'] = True  # e.g. from a loaded torch state dict
    opt.param_groups[0]['params'][0].grad = torch.zeros(3)
    with pytest.raises(NotImplementedError, match='amsgrad'):
        opt.step()


def test_uses_torch_threads(kernel):
    """The kernel runs in torch's OpenMP pool: results do not depend on the thread count."""
    n = 1 << 20
    master, g = torch.randn(n), torch.randn(n)
    results = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            p, m, v = master.clone(), torch.zeros(n), torch.zeros(n)
            adam_step(p, g, m, v, 1, LR, *BETAS, EPS, 0.1, True)
            results.append(p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
