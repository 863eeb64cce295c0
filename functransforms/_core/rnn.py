"""torch's recurrent kernels (RNN, GRU, LSTM: cells and whole sequences) under the transforms.

Note [RNN kernels under transforms]
    ``nn.RNNCell``, ``nn.GRUCell``, ``nn.LSTMCell``, ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` call
    one CompositeImplicitAutograd op each (``aten::gru_cell``, ``aten::gru.input``, ...) whose C++
    kernel computes in place on buffers it makes and holds (``linear_hh(hx).add_(gates)``). When
    only the input side carries a transform's value (a constant hidden state and constant
    weights: grad or jvp with respect to the input, vmap over the input), that write puts a
    wrapper into a plain buffer the kernel keeps computing with in C++, where no rule sees it:
    the transforms refuse it (Note [Buffers held by kernels], ``autodiff/_util.py``). So these ops
    are composite kernels of ours (Note [Composite kernels of ours], ``_core/composites.py``):
    with a transform's value among the arguments they run the recurrence below with out-of-place
    ops, each of which goes through the transforms' rules.

    The formulas and gate orders are torch's (the C++ cells in ``aten/src/ATen/native/RNN.cpp``,
    as ``torch/_decomp/decompositions.py`` restates them): RNN ``h' = act(W_ih x + b_ih + W_hh h
    + b_hh)``; GRU gates ``r, z, n`` with ``n = tanh(i_n + r * h_n)`` and ``h' = (h - n) z + n``;
    LSTM gates ``i, f, g, o``, ``c' = f c + i g``, ``h' = o tanh(c')``, then ``W_hr h'`` with
    projections. A whole sequence computes each layer's input projection for all time steps at
    once (as torch does) and steps the recurrence; packed sequences (the ``.data`` overloads)
    step over ``batch_sizes`` as torch's packed layers do; dropout between layers is
    ``torch.dropout`` on each layer's output but the last, as torch applies it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# -- cells ----------------------------------------------------------------------------------------
# Each step function takes the input's projection ``gi = W_ih x + b_ih`` (computed for a whole
# sequence at once, or per step by the cell ops) and returns the new hidden state.
def _tanh_step(gi, h, w_hh, b_hh, w_hr=None):
    return torch.tanh(F.linear(h, w_hh, b_hh) + gi)


def _relu_step(gi, h, w_hh, b_hh, w_hr=None):
    return torch.relu(F.linear(h, w_hh, b_hh) + gi)


def _gru_step(gi, h, w_hh, b_hh, w_hr=None):
    # a whole layer hands over its gates split once (one op per layer, not one per step)
    i_r, i_z, i_n = gi if type(gi) is tuple else gi.chunk(3, -1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, -1)
    r = torch.sigmoid(h_r + i_r)
    z = torch.sigmoid(h_z + i_z)
    n = torch.tanh(i_n + h_n * r)
    return (h - n) * z + n


def _lstm_step(gi, hc, w_hh, b_hh, w_hr=None):
    h, c = hc
    i, f, g, o = (F.linear(h, w_hh, b_hh) + gi).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return (h if w_hr is None else F.linear(h, w_hr), c)


def _check_cell(name, input, hx, w_ih, w_hh):
    """torch's checks of a cell's shapes (``check_rnn_cell_forward_*``), on the logical shapes:
    without them a mismatch could broadcast into a wrong result."""
    if input.dim() != 2 or input.shape[1] != w_ih.shape[1]:
        raise RuntimeError(
            f"{name}: input has inconsistent input_size: got {tuple(input.shape)}, expected "
            f"[batch, {w_ih.shape[1]}]"
        )
    for k, h in enumerate(hx):
        if h.dim() != 2 or h.shape[0] != input.shape[0]:
            raise RuntimeError(
                f"{name}: hidden{k} has shape {tuple(h.shape)}, expected batch size "
                f"{input.shape[0]} (the input's)"
            )
    if hx[0].shape[1] != w_hh.shape[1]:
        raise RuntimeError(
            f"{name}: hidden0 has inconsistent hidden_size: got {hx[0].shape[1]}, expected "
            f"{w_hh.shape[1]}"
        )


def _cell(name, step):
    def cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        _check_cell(name, input, (hx,), w_ih, w_hh)
        return step(F.linear(input, w_ih, b_ih), hx, w_hh, b_hh)

    return cell


def _lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    if len(hx) != 2:
        raise RuntimeError(f"lstm_cell: expected two hidden states (h, c), got {len(hx)}")
    _check_cell("lstm_cell", input, hx, w_ih, w_hh)
    return _lstm_step(F.linear(input, w_ih, b_ih), tuple(hx), w_hh, b_hh)


# -- layers ---------------------------------------------------------------------------------------
def _layer(step, x, h, p, reverse):
    """One layer, one direction, over a padded sequence ``x [T, B, I]``: ``(out [T, B, H], h)``."""
    w_ih, w_hh, b_ih, b_hh, w_hr = p
    if x.shape[0] == 0:
        raise RuntimeError("Expected sequence length to be larger than 0 in RNN")  # as torch
    gis = F.linear(x, w_ih, b_ih)
    if step is _gru_step:
        gis = tuple(zip(*(g.unbind(0) for g in gis.chunk(3, -1))))
    else:
        gis = gis.unbind(0)
    outs = [None] * len(gis)
    for t in reversed(range(len(gis))) if reverse else range(len(gis)):
        h = step(gis[t], h, w_hh, b_hh, w_hr)
        outs[t] = h[0] if type(h) is tuple else h
    return torch.stack(outs), h


def _rows(h, start, stop):
    return tuple(v[start:stop] for v in h) if type(h) is tuple else h[start:stop]


def _cat_rows(parts):
    if type(parts[0]) is tuple:
        return tuple(torch.cat(vs) for vs in zip(*parts))
    return torch.cat(parts)


def _packed_layer(step, x, h0, p, reverse, sizes):
    """One layer, one direction, over a packed sequence ``x [sum(sizes), I]`` (time-major, the
    batch shrinking along ``sizes``): each sequence's final state is its state after its last
    step; in reverse, sequences join the batch as they start."""
    w_ih, w_hh, b_ih, b_hh, w_hr = p
    pieces = torch.split(x, sizes)
    outs = [None] * len(sizes)
    if not reverse:
        h, finished = _rows(h0, 0, sizes[0]), []
        for t, n in enumerate(sizes):
            last = h[0].shape[0] if type(h) is tuple else h.shape[0]
            if n < last:  # sequences n.. ended at the previous step
                finished.append(_rows(h, n, last))
                h = _rows(h, 0, n)
            h = step(F.linear(pieces[t], w_ih, b_ih), h, w_hh, b_hh, w_hr)
            outs[t] = h[0] if type(h) is tuple else h
        return torch.cat(outs), _cat_rows([h, *reversed(finished)])
    h = _rows(h0, 0, sizes[-1])
    for t in reversed(range(len(sizes))):
        n, last = sizes[t], sizes[t + 1] if t + 1 < len(sizes) else sizes[-1]
        if n > last:  # sequences last.. start here
            h = _cat_rows([h, _rows(h0, last, n)])
        h = step(F.linear(pieces[t], w_ih, b_ih), h, w_hh, b_hh, w_hr)
        outs[t] = h[0] if type(h) is tuple else h
    return torch.cat(outs), h


def _groups(name, params, has_biases, has_proj, count):
    """The weights of each layer and direction as ``(w_ih, w_hh, b_ih, b_hh, w_hr)``."""
    size = 2 + 2 * has_biases + has_proj
    if len(params) != size * count:
        raise RuntimeError(
            f"{name}: got {len(params)} parameter tensors, expected {size * count} "
            f"({count} layers x directions of {size})"
        )
    out = []
    for k in range(0, len(params), size):
        g = params[k : k + size]
        w_hr = g[-1] if has_proj else None
        b_ih, b_hh = (g[2], g[3]) if has_biases else (None, None)
        out.append((g[0], g[1], b_ih, b_hh, w_hr))
    return out


def _run(name, step, x, hx, params, flags, batch_first, sizes):
    """A whole-sequence op: its layers and directions, ``(output, final states...)``.
    ``flags``: ``(has_biases, num_layers, dropout, train, bidirectional)`` as torch passes them."""
    has_biases, num_layers, dropout, train, bidirectional = flags
    if step is _lstm_step:
        if len(hx) != 2:
            raise RuntimeError(f"{name}: expected two hidden states (h, c), got {len(hx)}")
        hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
        has_proj = hx[0].shape[-1] != hx[1].shape[-1]
    else:
        hiddens, has_proj = hx.unbind(0), False
    dirs = 2 if bidirectional else 1
    groups = _groups(name, params, has_biases, has_proj, num_layers * dirs)
    if len(hiddens) != num_layers * dirs:
        raise RuntimeError(
            f"{name}: expected an initial hidden state of {num_layers * dirs} layers x "
            f"directions, got {len(hiddens)}"
        )
    if batch_first:
        x = x.transpose(0, 1)
    finals = []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            if sizes is None:
                out, h = _layer(step, x, hiddens[k], groups[k], d == 1)
            else:
                out, h = _packed_layer(step, x, hiddens[k], groups[k], d == 1, sizes)
            outs.append(out)
            finals.append(h)
        x = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    if batch_first:
        x = x.transpose(0, 1)
    if step is _lstm_step:
        return x, torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals])
    return x, torch.stack(finals)


def _sequence(name, step):
    """The ``.input`` (padded) and ``.data`` (packed) overloads of a whole-sequence op."""

    def padded(input, hx, params, has_biases, num_layers, dropout, train, bidir, batch_first):
        flags = (has_biases, num_layers, dropout, train, bidir)
        return _run(name, step, input, hx, params, flags, batch_first, None)

    def packed(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidir):
        from .composites import read_sizes  # (it imports this module)

        sizes = read_sizes(batch_sizes, f"{name} on a packed sequence: the batch_sizes")
        flags = (has_biases, num_layers, dropout, train, bidir)
        return _run(name, step, data, hx, params, flags, False, sizes)

    return padded, packed


_rnn_tanh, _rnn_tanh_packed = _sequence("rnn_tanh", _tanh_step)
_rnn_relu, _rnn_relu_packed = _sequence("rnn_relu", _relu_step)
_gru, _gru_packed = _sequence("gru", _gru_step)
_lstm, _lstm_packed = _sequence("lstm", _lstm_step)

KERNELS = {  # registered by _composites.install
    "rnn_tanh_cell": _cell("rnn_tanh_cell", _tanh_step),
    "rnn_relu_cell": _cell("rnn_relu_cell", _relu_step),
    "gru_cell": _cell("gru_cell", _gru_step),
    "lstm_cell": _lstm_cell,
    "rnn_tanh.input": _rnn_tanh,
    "rnn_tanh.data": _rnn_tanh_packed,
    "rnn_relu.input": _rnn_relu,
    "rnn_relu.data": _rnn_relu_packed,
    "gru.input": _gru,
    "gru.data": _gru_packed,
    "lstm.input": _lstm,
    "lstm.data": _lstm_packed,
}
