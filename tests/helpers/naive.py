"""A deliberately naive oracle for the reference: scalar loops over every element, in float64.

Written from the contract's rules without looking at the reference, so that the two disagree
whenever one of them misreads the contract. Only for tiny shapes.
"""

from __future__ import annotations

import math

import torch


def _act(v: float, activation: str | None) -> float:
    return v / (1.0 + math.exp(-v)) if activation in ("silu", "swish") else v


def conv_fn(x, weight, bias=None, *, conv_states=None, cache_indices=None, has_initial_state=None,
            query_start_loc=None, activation=None, pad_slot_id=-1):
    D, W = weight.shape
    if query_start_loc is None:
        seqs = [(b, [x[b, t] for t in range(x.shape[1])]) for b in range(x.shape[0])]
    else:
        q = [int(v) for v in query_start_loc]
        seqs = [(b, [x[t] for t in range(q[b], q[b + 1])]) for b in range(len(q) - 1)]
    out = torch.zeros(x.shape, dtype=torch.float64)
    new_states = {}
    row0 = 0
    for b, rows in seqs:
        slot = int(cache_indices[b]) if cache_indices is not None else b
        L = len(rows)
        if cache_indices is not None and slot == pad_slot_id:
            row0 += L
            continue
        S = conv_states.shape[1] if conv_states is not None else W - 1
        use_init = conv_states is not None and has_initial_state is not None and bool(has_initial_state[b])
        hist = [[float(conv_states[slot, S - (W - 1) + j, d]) if use_init else 0.0 for d in range(D)]
                for j in range(W - 1)]
        h = hist + [[float(r[d]) for d in range(D)] for r in rows]
        for t in range(L):
            for d in range(D):
                acc = float(bias[d]) if bias is not None else 0.0
                for k in range(W):
                    acc += float(weight[d, k]) * h[t + k][d]
                v = _act(acc, activation)
                if query_start_loc is None:
                    out[b, t, d] = v
                else:
                    out[row0 + t, d] = v
        if conv_states is not None:
            new_states[slot] = h[len(h) - (W - 1):]
        row0 += L
    for slot, rows in new_states.items():
        S = conv_states.shape[1]
        for j, r in enumerate(rows):
            for d in range(D):
                conv_states[slot, S - (W - 1) + j, d] = r[d]
    return out.to(x.dtype)


def conv_update(x, conv_state, weight, bias=None, *, activation=None, conv_state_indices=None,
                num_accepted_tokens=None, pad_slot_id=-1):
    D, W = weight.shape
    x3 = x.unsqueeze(1) if x.ndim == 2 else x
    B, L, _ = x3.shape
    S = conv_state.shape[1]
    out = torch.zeros(x3.shape, dtype=torch.float64)
    new_states = {}
    for b in range(B):
        slot = int(conv_state_indices[b]) if conv_state_indices is not None else b
        if conv_state_indices is not None and slot == pad_slot_id:
            continue
        old = [[float(conv_state[slot, j, d]) for d in range(D)] for j in range(S)]
        new = [[float(x3[b, t, d]) for d in range(D)] for t in range(L)]
        if num_accepted_tokens is None:
            hist = old[S - (W - 1):] if W > 1 else []
            stream = old + new
        else:
            n = int(num_accepted_tokens[b])
            hist = old[n - 1 : n - 1 + W - 1]
            stream = old[n : n + max(S - L, 0)] + new
        h = hist + new
        for t in range(L):
            for d in range(D):
                acc = float(bias[d]) if bias is not None else 0.0
                for k in range(W):
                    acc += float(weight[d, k]) * h[t + k][d]
                out[b, t, d] = _act(acc, activation)
        new_states[slot] = stream[len(stream) - S:]
    for slot, rows in new_states.items():
        for j, r in enumerate(rows):
            for d in range(D):
                conv_state[slot, j, d] = r[d]
    out = out.to(x.dtype)
    return out.squeeze(1) if x.ndim == 2 else out
