"""CPUAdam and HybridAdam: Adam/AdamW whose CPU parameters update through the fused C++ kernel.

``adam_step`` is the functional entry (one flat tensor: a ZeRO shard, a parameter);
``CPUAdam`` / ``HybridAdam`` are ``torch.optim.Optimizer``s with torch.optim.AdamW's
hyperparameters and state keys (``step``, ``exp_avg``, ``exp_avg_sq``), so their
``state_dict()`` loads into torch.optim.AdamW and back. HybridAdam updates each parameter
where it lives: CPU tensors through the kernel, accelerator tensors through torch's fused
Adam/AdamW (or NVIDIA apex's FusedAdam kernel when apex is installed). Nothing here talks
to other processes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw

from ._kernel import any_nonfinite, kernel_for, resolve_backend
from ._torch_adam import torch_adam_update

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_operands(master, grad, exp_avg, exp_avg_sq, out_lowp):
    n = master.numel()
    for name, t in (('grad', grad), ('exp_avg', exp_avg), ('exp_avg_sq', exp_avg_sq),
                    ('out_lowp', out_lowp)):
        if t is None:
            continue
        if t.numel() != n:
            raise ValueError(f'adam_step: {name} has {t.numel()} elements, the parameter has {n}')
        if t.device != master.device:
            raise ValueError(f'adam_step: {name} is on {t.device}, '
                             f'the parameter on {master.device}')
        if t.dtype not in _FLOATS:
            raise ValueError(f'adam_step: {name} must be float32/float16/bfloat16, got {t.dtype}')
    if master.dtype not in _FLOATS:
        raise ValueError(f'adam_step: the parameter must be float32/float16/bfloat16, '
                         f'got {master.dtype}')
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise ValueError(f'adam_step: exp_avg and exp_avg_sq must be float32, got '
                         f'{exp_avg.dtype} and {exp_avg_sq.dtype}')


def adam_step(master_fp32: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, adamw: bool, loss_scale: float = 1.0,
              out_lowp: Optional[torch.Tensor] = None, check_finite: bool = True,
              backend: Optional[str] = None) -> bool:
    """One Adam (``adamw=False``: L2 added to the gradient) or AdamW step, in place.

    ``master_fp32`` (fp32; fp16/bf16 also accepted, then computed in fp32 and rounded back),
    ``grad`` (any float dtype; divided by ``loss_scale``), and the fp32 moments hold the same
    number of elements (any shape, e.g. one flat shard). ``step`` counts this step (1 for the
    first). ``out_lowp`` (fp16/bf16/fp32, optional) receives the updated parameter.
    Returns found_inf: with ``check_finite`` and an inf/nan in ``grad``, nothing is written
    (pass ``check_finite=False`` when the caller has already checked, e.g. across ranks).
    CPU tensors run the C++ kernel; others, or ``backend='torch'``, the torch implementation.
    """
    _check_operands(master_fp32, grad, exp_avg, exp_avg_sq, out_lowp)
    if step < 1:
        raise ValueError(f'adam_step: step must be >= 1 (bias correction), got {step}')
    if not loss_scale > 0:
        raise ValueError(f'adam_step: loss_scale must be > 0, got {loss_scale}')
    args = (int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            bool(adamw), float(loss_scale), bool(check_finite))
    ext, simd = kernel_for(backend)
    tensors = (master_fp32, grad, exp_avg, exp_avg_sq, out_lowp)
    if ext is None or master_fp32.device.type != 'cpu' or not all(
            t is None or t.is_contiguous() for t in tensors):
        return torch_adam_update(*tensors, *args)
    return bool(ext.adam_update(*tensors, *args, simd))


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over CPU parameters through the fused kernel (torch for others).

    ``adamw_mode=True`` is AdamW (decoupled decay, as torch.optim.AdamW), False is Adam with
    L2 (as torch.optim.Adam). Moments are fp32 for every CPU parameter (fp16/bf16 parameters
    are computed in fp32 and rounded back). ``step(loss_scale=s)`` divides gradients by
    ``s``; with ``check_finite=True`` a step whose gradients hold inf/nan is skipped whole
    (no parameter, moment or step count changes) and ``self.found_inf`` says so. Off by
    default, as in torch.optim.AdamW: the decision is local, so with sharded gradients (ZeRO,
    tensor parallelism) agree on overflow across ranks first, as colossal_lite's AMP does.
    ``backend``: 'auto' | 'avx512' | 'avx2' | 'scalar' | 'torch' (None: $COLOSSAL_LITE_CPU_ADAM).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, *,
                 check_finite: bool = False, backend: Optional[str] = None,
                 amsgrad: bool = False, maximize: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f'lr, eps and weight_decay must be >= 0, '
                             f'got {lr}, {eps}, {weight_decay}')
        if amsgrad or maximize:
            raise NotImplementedError('CPUAdam/HybridAdam implement neither amsgrad nor maximize.')
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f'betas must lie in [0, 1), got {tuple(betas)}')
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        self.check_finite = check_finite
        self.backend = resolve_backend(backend) if backend is not None else None
        self.found_inf = False

    # -- hyperparameters of a group (a torch.optim group's keys are accepted as they are) --
    def _group_args(self, group) -> dict:
        if group.get('amsgrad', False) or group.get('maximize', False):
            raise NotImplementedError('CPUAdam/HybridAdam implement neither amsgrad nor maximize.')
        beta1, beta2 = group['betas']
        return dict(lr=float(group['lr']), beta1=float(beta1), beta2=float(beta2),
                    eps=float(group['eps']), weight_decay=float(group['weight_decay']),
                    adamw=bool(group.get('adamw_mode', self.defaults['adamw_mode'])))

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            on_cpu = p.device.type == 'cpu'
            moment_dtype = torch.float32 if on_cpu else p.dtype
            state['step'] = torch.zeros((), dtype=torch.float32,
                                        device='cpu' if on_cpu else p.device)
            state['exp_avg'] = torch.zeros_like(p, dtype=moment_dtype,
                                                memory_format=torch.preserve_format)
            state['exp_avg_sq'] = torch.zeros_like(p, dtype=moment_dtype,
                                                   memory_format=torch.preserve_format)
        return state

    def _with_grads(self) -> List[tuple]:
        """(group, param) for every parameter that has a gradient."""
        out = []
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise NotImplementedError('CPUAdam/HybridAdam do not take sparse gradients.')
                out.append((group, p))
        return out

    def _nonfinite(self, pairs) -> bool:
        return any(any_nonfinite(p.grad, self.backend) for _, p in pairs)

    def _cpu_update(self, group, p, loss_scale: float):
        state = self._state(p)
        state['step'] += 1
        args = self._group_args(group)
        adam_step(p.data, p.grad, state['exp_avg'], state['exp_avg_sq'], int(state['step'].item()),
                  args['lr'], args['beta1'], args['beta2'], args['eps'], args['weight_decay'],
                  args['adamw'], loss_scale=loss_scale, check_finite=False, backend=self.backend)

    def _device_update(self, group, params: List[torch.Tensor], loss_scale: float):
        raise NotImplementedError(
            f'CPUAdam updates CPU parameters only, got one on {params[0].device}; use HybridAdam.')

    @torch.no_grad()
    def step(self, closure=None, *, loss_scale: float = 1.0):
        """One step over every parameter with a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not loss_scale > 0:
            raise ValueError(f'loss_scale must be > 0, got {loss_scale}')
        pairs = self._with_grads()
        self.found_inf = self.check_finite and self._nonfinite(pairs)
        if self.found_inf:
            return loss
        on_device: Dict[tuple, List[torch.Tensor]] = defaultdict(list)
        for group, p in pairs:
            if p.device.type == 'cpu':
                self._cpu_update(group, p, loss_scale)
            else:
                on_device[(id(group), p.device, p.dtype)].append(p)
        groups = {id(g): g for g in self.param_groups}
        for (gid, _, _), params in on_device.items():
            self._device_update(groups[gid], params, loss_scale)
        return loss

    def load_state_dict(self, state_dict):
        """Loads our own or torch.optim.Adam/AdamW's state dict (each parameter's state put
        where :meth:`place_state` says); group keys torch's dict lacks (``adamw_mode``) take
        this optimizer's defaults."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            for p in group['params']:
                if self.state.get(p):
                    self.state[p] = self.place_state(p, self.state[p], copy=True)

    @staticmethod
    def place_state(p: torch.Tensor, state: dict, copy: bool = False) -> dict:
        """``state`` of ``p`` (from a state dict or a checkpoint) where the step uses it: the
        step count a float32 scalar tensor beside ``p`` (on the CPU for a CPU parameter, on
        the device for a device one, as torch's fused Adam reads it there), moments on
        ``p``'s device (fp32 for a CPU parameter, ``p``'s dtype otherwise), contiguous.
        With ``copy`` every tensor is this optimizer's own (a state dict from a live
        optimizer would otherwise share its moments, and both would update them); without,
        tensors already in place are kept (a checkpoint's freshly loaded targets). The step
        is always a fresh tensor."""
        on_cpu = p.device.type == 'cpu'
        placed = dict(state)
        placed['step'] = torch.as_tensor(state['step'], dtype=torch.float32).to(
            'cpu' if on_cpu else p.device).clone()
        for key in ('exp_avg', 'exp_avg_sq'):
            if key in state:
                dtype = torch.float32 if on_cpu else p.dtype
                moved = state[key].to(device=p.device, dtype=dtype).contiguous()
                placed[key] = moved.clone() if copy and moved is state[key] else moved
        return placed


class HybridAdam(CPUAdam):
    """CPUAdam whose accelerator parameters update through torch's fused Adam/AdamW
    (``torch.optim.adamw.adamw`` / ``torch.optim.adam.adam`` with ``fused=True``: one
    multi-tensor launch per group, device and dtype; the loss scale goes in as its
    ``grad_scale``), or apex's ``multi_tensor_adam`` kernel when NVIDIA apex is installed. Each parameter
    updates where it lives, so a ZeRO shard moved between CPU and device keeps its state."""

    def _device_update(self, group, params: List[torch.Tensor], loss_scale: float):
        args = self._group_args(group)
        states = [self._state(p) for p in params]
        grads = [p.grad for p in params]
        if _apex_adam() is not None and params[0].is_cuda:
            _apex_update(params, grads, states, args, loss_scale)
            return
        grad_scale = None
        if loss_scale != 1.0:
            grad_scale = torch.full((), loss_scale, dtype=torch.float32, device=params[0].device)
        fused = torch_adamw if args['adamw'] else torch_adam  # torch's functional entries
        fused(params, grads, [s['exp_avg'] for s in states], [s['exp_avg_sq'] for s in states], [],
              [s['step'] for s in states], fused=True, grad_scale=grad_scale, found_inf=None,
              amsgrad=False, beta1=args['beta1'], beta2=args['beta2'], lr=args['lr'],
              weight_decay=args['weight_decay'], eps=args['eps'], maximize=False)


def _apex_adam():
    """apex's ``amp_C.multi_tensor_adam`` and its applier when NVIDIA apex is installed."""
    try:
        import amp_C  # noqa: F401  (NVIDIA apex's CUDA extension; the registry's `apex` has none)
        from apex.multi_tensor_apply import multi_tensor_applier
        return amp_C.multi_tensor_adam, multi_tensor_applier
    except Exception:
        return None


def _apex_update(params, grads, states, args, loss_scale: float):
    kernel, applier = _apex_adam()
    if loss_scale != 1.0:
        grads = torch._foreach_div(grads, loss_scale)
    for s in states:
        s['step'] += 1
    step = int(states[0]['step'].item())
    if any(int(s['step'].item()) != step for s in states):
        raise NotImplementedError('apex FusedAdam needs one step count per parameter group.')
    noop = torch.zeros(1, dtype=torch.int, device=params[0].device)
    applier(kernel, noop, [grads, params, [s['exp_avg'] for s in states],
                           [s['exp_avg_sq'] for s in states]],
            args['lr'], args['beta1'], args['beta2'], args['eps'], step,
            1 if args['adamw'] else 0, 1, args['weight_decay'])
