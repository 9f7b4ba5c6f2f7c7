"""ViT (tiny preset) on scikit-learn's 8x8 digits: every tensor mode trains like serial.

Same seed, same initial weights (the serial model's state_dict), same batches and
hyper-parameters in serial, data parallel (4 ranks), 1D (4), 2D (q=2, 4), 2.5D
(q=2, d=2, 8) and 3D (q=2, 8; when ``colossal_lite.nn.parallel_3d`` exists). Each run
records the training loss and the test accuracy after every epoch; the final test
accuracy of every mode must be within 1 point of serial. Writes
benchmarks/results/vit_convergence.json and .png.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/vit_convergence.py``
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossal_lite.nn as col_nn  # noqa: E402
from benchmarks._common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402
from colossal_lite.context import ParallelMode, global_context as gpc  # noqa: E402
from colossal_lite.engine import allreduce_gradients  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402
from model_zoo import ViT  # noqa: E402

EPOCHS, BATCH, LR, SEED = 20, 64, 5e-3, 0


def load_data():
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SEED))
    test_n = 360  # divisible by every split of the batch (4 and 8)
    test, train = order[:test_n], order[test_n:]
    steps = len(train) // BATCH
    return images[train], labels[train], images[test], labels[test], steps


def _replica_rows(t):
    """This data-parallel replica's rows of a global batch (all rows without DP)."""
    parts = gpc.get_world_size(ParallelMode.DATA) if gpc.is_initialized(ParallelMode.DATA) else 1
    if parts == 1:
        return t
    return t.chunk(parts)[gpc.get_local_rank(ParallelMode.DATA)]


def train(rank=0, state=None):
    torch.manual_seed(SEED)
    x_train, y_train, x_test, y_test, steps = load_data()
    model = ViT.from_preset('tiny')
    if state is not None:
        model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * steps)
    criterion = col_nn.CrossEntropyLoss()
    curve = []
    for epoch in range(EPOCHS):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(1000 + epoch))
        model.train()
        losses = []
        for step in range(steps):
            idx = perm[step * BATCH:(step + 1) * BATCH]
            opt.zero_grad()
            loss = criterion(model(_replica_rows(x_train[idx])), _replica_rows(y_train[idx]))
            loss.backward()
            allreduce_gradients(model.parameters())
            opt.step()
            sched.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            logits = col_nn.gather_logits(model(x_test))
        acc = (logits.argmax(-1) == y_test).float().mean().item() * 100
        curve.append(dict(epoch=epoch + 1, train_loss=float(np.mean(losses)), test_acc=acc))
    return curve


def runs():
    out = [('data parallel', 4, None), ('1d', 4, dict(size=4, mode='1d')),
           ('2d', 4, dict(size=4, mode='2d')), ('2.5d', 8, dict(size=8, mode='2.5d', depth=2))]
    if importlib.util.find_spec('colossal_lite.nn.parallel_3d') is not None:
        out.append(('3d', 8, dict(size=8, mode='3d')))
    return out


def plot(curves, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, curve in curves.items():
        epochs = [c['epoch'] for c in curve]
        style = dict(marker='o', markersize=3, linestyle='--' if name == 'serial' else '-')
        ax1.plot(epochs, [c['train_loss'] for c in curve], label=name, **style)
        ax2.plot(epochs, [c['test_acc'] for c in curve], label=name, **style)
    ax1.set(xlabel='epoch', ylabel='training loss', title='ViT-tiny on digits: loss')
    ax2.set(xlabel='epoch', ylabel='test accuracy (%)', title='test accuracy')
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    torch.manual_seed(SEED)
    state = ViT.from_preset('tiny').state_dict()
    start = time.perf_counter()
    curves = {'serial': train(0, state)}
    seconds = {'serial': time.perf_counter() - start}
    for name, world, tensor in runs():
        start = time.perf_counter()
        config = dict(parallel=dict(tensor=tensor)) if tensor else {}
        curves[name] = run_distributed(train, world, config, state, timeout=900)[0]
        seconds[name] = time.perf_counter() - start
    serial_acc = curves['serial'][-1]['test_acc']
    rows = [['mode', 'final train loss', 'final test acc %', 'diff vs serial (points)', 'wall s']]
    summary = {}
    for name, curve in curves.items():
        acc = curve[-1]['test_acc']
        summary[name] = dict(final_test_acc=acc, final_train_loss=curve[-1]['train_loss'],
                             acc_diff_vs_serial=acc - serial_acc,
                             within_1_point=abs(acc - serial_acc) <= 1.0, wall_s=seconds[name])
        rows.append([name, f"{curve[-1]['train_loss']:.4f}", f'{acc:.2f}',
                     f'{acc - serial_acc:+.2f}', f'{seconds[name]:.0f}'])
    print_table(rows)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    plot(curves, os.path.join(RESULTS_DIR, 'vit_convergence.png'))
    path = write_json('vit_convergence', dict(
        setup=dict(model='ViT tiny preset', data='sklearn digits 8x8, 1437 train / 360 test',
                   epochs=EPOCHS, batch=BATCH, lr=LR, optimizer='AdamW(wd=0.01), cosine decay to 0 over all steps', seed=SEED),
        summary=summary, curves=curves, environment=environment()))
    print('wrote', path)
    bad = [n for n, s in summary.items() if not s['within_1_point']]
    if bad:
        raise SystemExit(f'final accuracy differs from serial by more than 1 point: {bad}')


if __name__ == '__main__':
    main()
