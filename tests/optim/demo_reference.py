"""An independent, deliberately plain DeMo (arXiv 2411.19870) for the tests to compare against.

Per tensor, per chunk, per rank loops; DCT-II from its textbook formula; no code shared
with ``lynx.optim``. Simulates all W ranks in one process: one momentum per rank, one
(replicated) parameter set.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def dct2_matrix(n: int) -> np.ndarray:
    d = np.zeros((n, n))
    for k in range(n):
        scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
        for i in range(n):
            d[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return d


def divisor_at_most(n: int, target: int) -> int:
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def as_matrix(t: np.ndarray) -> np.ndarray:
    if t.ndim == 0:
        return t.reshape(1, 1)
    if t.ndim == 1:
        return t.reshape(1, -1)  # a vector: one row, chunked along its length only
    return t.reshape(-1, t.shape[-1])  # leading dimensions flattened into rows


class ReferenceDeMo:
    def __init__(self, params, world, lr, decay, topk, chunk, weight_decay, value_dtype):
        self.params = [p.detach().clone().double().numpy() for p in params]
        self.world, self.lr, self.decay, self.topk = world, lr, decay, topk
        self.chunk, self.wd, self.value_dtype = chunk, weight_decay, value_dtype
        self.momenta = [[np.zeros_like(p) for p in self.params] for _ in range(world)]

    def _round(self, v: np.ndarray) -> np.ndarray:
        return torch.from_numpy(v).to(self.value_dtype).double().numpy()

    def _chunking(self, shape):
        mat = as_matrix(np.zeros(shape))
        rows, cols = mat.shape
        cr = divisor_at_most(rows, self.chunk) if len(shape) >= 2 else 1
        cc = divisor_at_most(cols, self.chunk)
        return rows, cols, cr, cc

    def _pays(self, shape, elems, n_chunks) -> bool:
        k = min(self.topk, elems)
        if k >= elems:
            return False
        bits = max(1, (elems - 1).bit_length())
        value_size = torch.empty((), dtype=self.value_dtype).element_size()
        sparse = n_chunks * k * value_size + math.ceil(n_chunks * k * bits / 8)
        return sparse < int(np.prod(shape)) * 8  # float64 parameters

    def step(self, grads_per_rank):
        for t, p in enumerate(self.params):
            rows, cols, cr, cc = self._chunking(p.shape)
            dr, dc = dct2_matrix(cr), dct2_matrix(cc)
            elems, n_chunks = cr * cc, (rows // cr) * (cols // cc)
            k = min(self.topk, elems)
            if not self._pays(p.shape, elems, n_chunks):
                total = np.zeros_like(p)
                for r in range(self.world):
                    m = self.momenta[r][t]
                    m[...] = self.decay * m + self.lr * grads_per_rank[r][t].double().numpy()
                    total += m
                    m[...] = 0.0
                update = total / self.world
            else:
                n_r, n_c = rows // cr, cols // cc
                sums = np.zeros((n_r, n_c, elems))  # per chunk: sum of the values sent
                counts = np.zeros((n_r, n_c, elems))  # per chunk: how many ranks sent each
                for r in range(self.world):
                    m = self.momenta[r][t]
                    m[...] = self.decay * m + self.lr * grads_per_rank[r][t].double().numpy()
                    mat = as_matrix(m)  # a view: edits reach m
                    for a in range(n_r):
                        for b in range(n_c):
                            block = mat[a * cr : (a + 1) * cr, b * cc : (b + 1) * cc]
                            coeffs = (dr @ block @ dc.T).reshape(-1)
                            order = np.argsort(-np.abs(coeffs), kind="stable")[:k]
                            sent = np.zeros_like(coeffs)
                            sent[order] = self._round(coeffs[order])
                            sums[a, b, order] += sent[order]
                            counts[a, b, order] += 1
                            block -= dr.T @ sent.reshape(cr, cc) @ dc  # error feedback
                out = np.zeros((rows, cols))
                for a in range(n_r):
                    for b in range(n_c):
                        mean = np.where(counts[a, b] > 0, sums[a, b] / np.maximum(counts[a, b], 1), 0.0)
                        out[a * cr : (a + 1) * cr, b * cc : (b + 1) * cc] = dr.T @ mean.reshape(cr, cc) @ dc
                update = out.reshape(p.shape)
            p *= 1.0 - self.lr * self.wd
            p -= self.lr * np.sign(update)

    def tensors(self):
        return [torch.from_numpy(p.copy()) for p in self.params]
