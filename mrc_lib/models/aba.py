"""Adaptive Bi-directional Attention (Chen, Liu, You, Zhou & Zou, ICASSP 2021).

A reader's encoder turns each word into a stack of representations, from fine (the embedding
``E``) to coarse (the last encoder layer ``Cⁿ``); the answer layer usually sees only the
coarsest. ABA gives the answer layer the whole *history of semantics* (Sec. 2.3):

* ``HOS_p = [E_p; C_p¹; …; C_pⁿ; A]`` and ``HOS_q = [E_q; C_q¹; …; C_qⁿ; A]`` (Eqs. 1-2), with
  ``A`` the output of the attention layer;
* ``ĤOS_pᵀ = λ^p ⊙ HOS_pᵀ`` and ``ĤOS_qᵀ = λ^q ⊙ HOS_qᵀ`` with two trainable matrices, the
  first column initialised to ones and the others to zeros (Eq. 3);
* ``H = dropout(f_attention[ĤOS_p, ĤOS_q])`` with BiDAF's trilinear function (Eq. 4); the row
  softmax ``Ĥ`` gives ``M = Ĥ · ĤOS_q``, the column softmax ``H̄`` the DCN-style
  ``S = Ĥ · H̄ᵀ · ĤOS_p``, and ``I = [ĤOS_p; M; ĤOS_p ⊙ M; ĤOS_p ⊙ S]`` is the input of the
  output layer.

Our reading of what the paper leaves open (the chapter names each alternative)
-----------------------------------------------------------------------------
1. *HOS and λ.* ``[·; ·]`` concatenates features, as in ``I``. ``λ`` has one entry per feature
   of ``HOS``, in one block ("column") per granularity: with granularities of equal width ``d``
   it is a ``d × (n + 2)`` matrix (the paper gives no shape, only "the first column" and "the
   remaining columns"). It multiplies ``HOS`` element-wise at every word (the same ``λ`` at
   every position). Eq. 3 writes ``λ^p`` and ``λ^q``, the sentence after it one ``λ``: we
   train one per side.
2. *Order and start.* Eqs. 1-2 list ``E`` first, so the first column of ``λ`` (initialised to
   ones) is ``E``'s: at initialisation ``ĤOS = [E; 0; …; 0]`` (``hos_order="paper"``). The
   alternative, ``hos_order="newest_first"`` (``[Cⁿ; …; C¹; E; A]``), makes the kept column
   the one a base reader's attention reads.
3. *A on the question side.* ``A`` has one vector per passage word. A question word ``j``
   receives it averaged with the weights of the passage words that attended to ``j`` in the
   base reader's attention: ``A_q[j] = Σ_t ā_tj A_t / Σ_t ā_tj`` (:func:`question_side`).
4. *Where ``A`` comes from and where ``I`` goes* (``feed``). The paper: "selected MRC models
   will take I as input of the Output Layer". ``feed="output"`` (default): ``A`` is what the base
   reader's output layer reads (BiDAF++: the self-attention layer's output; QANet:
   ``[M0; M1; M2]``; SAN: the memory ``M``) and the output layer reads ``I`` instead.
   ``feed="attention"``: ``A`` is the base attention layer's projected output and ``I`` takes
   its place, through the base reader's projection and every layer after the attention.

Options that depart from the paper (off by default)
---------------------------------------------------
* ``lam="shared_scalar"``: one scalar per granularity shared by passage and question, each
  granularity first mapped to the width of the first by a bias-free linear map, and ``ĤOS``
  their weighted *sum* (the book's first version of the chapter).
* ``no_answer="head"`` (in the readers): a separate no-answer score with its own loss instead
  of the passage's last token (:func:`last_token_outputs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.inference import to_device
from mrc_lib.nn import (
    CoAttention,
    TrilinearSimilarity,
    decode_span,
    mask_logits,
    span_loss,
    zero_padding,
)

LAMBDAS = ("paper", "shared_scalar")
ORDERS = ("paper", "newest_first")
FEEDS = ("output", "attention")
NO_ANSWERS = ("last_token", "head")


def check_option(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise UserError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")


def granularities(encoder_layers: Sequence[Tensor], a: Tensor,
                  order: str = "paper") -> list[Tensor]:
    """``HOS`` (Eqs. 1-2) from ``encoder_layers = [E, C¹, …, Cⁿ]`` and ``A``: ``[E, C¹, …, Cⁿ,
    A]`` in the paper's order, ``[Cⁿ, …, C¹, E, A]`` with ``order="newest_first"``."""
    layers = list(encoder_layers) if order == "paper" else list(reversed(encoder_layers))
    return [*layers, a]


def granularity_names(n_layers: int, order: str = "paper") -> list[str]:
    """Labels of :func:`granularities` for ``n_layers`` encoder layers ``C¹ … Cⁿ``."""
    names = ["E", *(f"C{i}" for i in range(1, n_layers + 1))]
    return [*(names if order == "paper" else reversed(names)), "A"]


def question_side(a: Tensor, attn: Tensor, c_mask: Tensor) -> Tensor:
    """``A`` carried to the question words (reading 3): ``A_q[j] = Σ_t ā_tj A_t / Σ_t ā_tj``.

    ``a`` is ``[B, Lc, d]``, ``attn`` the base context-to-query map ``ā`` ``[B, Lc, Lq]`` (rows
    sum to 1 over the question); returns ``[B, Lq, d]``, zero at padded question words.
    """
    weights = zero_padding(attn, c_mask)
    weights = weights / weights.sum(dim=1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    return weights.transpose(1, 2) @ a


class ElementwiseLambda(nn.Module):
    """Eq. 3: ``ĤOSᵀ = λ ⊙ HOSᵀ`` over the concatenated granularities, one ``λ`` entry per
    feature, in blocks of the granularities' widths; the first block is initialised to ones,
    the others to zeros (reading 1)."""

    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        self.widths = list(widths)
        self.lam = nn.Parameter(torch.cat([torch.ones(widths[0]),
                                           torch.zeros(sum(widths[1:]))]))

    @property
    def out_dim(self) -> int:
        return sum(self.widths)

    def forward(self, hos: Sequence[Tensor]) -> Tensor:
        return self.lam * torch.cat(list(hos), dim=-1)

    def blocks(self) -> list[Tensor]:
        """``λ``'s columns, one per granularity."""
        return list(self.lam.split(self.widths))

    def terms(self, hos: Sequence[Tensor]) -> list[Tensor]:
        """Each granularity's part of ``ĤOS``: ``λ_k ⊙ HOS_k``."""
        return [lam * h for lam, h in zip(self.blocks(), hos)]


class SharedScalarLambda(nn.Module):
    """Departure (``lam="shared_scalar"``): ``ĤOS = Σ_k λ_k P_k(HOS_k)`` with one scalar per
    granularity, ``λ = [1, 0, …, 0]`` at initialisation, and ``P_k`` a bias-free linear map to
    the width of the first granularity (none for a granularity already that wide)."""

    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        self.dim = widths[0]
        self.project = nn.ModuleList(
            nn.Identity() if w == self.dim else nn.Linear(w, self.dim, bias=False)
            for w in widths)
        self.lam = nn.Parameter(torch.tensor([1.0] + [0.0] * (len(widths) - 1)))

    @property
    def out_dim(self) -> int:
        return self.dim

    def forward(self, hos: Sequence[Tensor]) -> Tensor:
        return sum(self.terms(hos))

    def blocks(self) -> list[Tensor]:
        return list(self.lam.reshape(-1, 1))

    def terms(self, hos: Sequence[Tensor]) -> list[Tensor]:
        return [lam * project(h) for lam, project, h in zip(self.lam, self.project, hos)]


class DroppedTrilinear(TrilinearSimilarity):
    """``H = dropout(f_attention[ĤOS_p, ĤOS_q])`` with BiDAF's trilinear ``f_attention``
    (Eq. 4)."""

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, c: Tensor, q: Tensor) -> Tensor:
        return self.dropout(super().forward(c, q))


class ABAttention(CoAttention):
    """``H`` of Eq. 4, then Sec. 2.3's unnumbered ``I = [ĤOS_p; M; ĤOS_p ⊙ M; ĤOS_p ⊙ S]``
    with ``M = Ĥ ĤOS_q`` (row softmax ``Ĥ``) and ``S = Ĥ H̄ᵀ ĤOS_p`` (column softmax ``H̄``):
    QANet's context-query attention over the weighted histories, with dropout on the
    similarity matrix."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__(dim)
        self.similarity = DroppedTrilinear(dim, dropout)


class AdaptiveBiAttention(nn.Module):
    """ABA over a base reader's history of semantics (Eqs. 1-4).

    Args:
        widths: the width of each granularity ``[E, C¹, …, Cⁿ, A]`` (always in this order).
        dropout: dropout on the similarity matrix ``H`` (Eq. 4).
        lam: ``"paper"`` (Eq. 3: ``λ^p``, ``λ^q`` element-wise) or ``"shared_scalar"``.
        hos_order: ``"paper"`` (``E`` first) or ``"newest_first"`` (``Cⁿ`` first).
        feed: ``"output"`` (``I`` to the output layer) or ``"attention"`` (in place of the base
            attention's output); recorded here for the reader, see :class:`ABAReader`.
        out_dim: map ``I`` to this width with a bias-free linear layer (``None``: ``I`` as is).
    """

    def __init__(self, widths: Sequence[int], dropout: float = 0.0, *, lam: str = "paper",
                 hos_order: str = "paper", feed: str = "output",
                 out_dim: int | None = None) -> None:
        super().__init__()
        check_option("lam", lam, LAMBDAS)
        check_option("hos_order", hos_order, ORDERS)
        check_option("feed", feed, FEEDS)
        self.hos_order, self.feed = hos_order, feed
        ordered = granularities(widths[:-1], widths[-1], hos_order)
        if lam == "paper":  # λ^p and λ^q
            self.lam_p, self.lam_q = ElementwiseLambda(ordered), ElementwiseLambda(ordered)
        else:  # one λ for both sides
            self.lam_p = self.lam_q = SharedScalarLambda(ordered)
        dim = self.lam_p.out_dim
        self.attention = ABAttention(dim, dropout)
        self.out = (nn.Identity() if out_dim in (None, 4 * dim)
                    else nn.Linear(4 * dim, out_dim, bias=False))
        self.out_dim = out_dim or 4 * dim

    def histories(self, p_layers: Sequence[Tensor], q_layers: Sequence[Tensor], a: Tensor,
                  base_attn: Tensor, c_mask: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """``HOS_p`` and ``HOS_q`` (Eqs. 1-2) as lists of granularities."""
        a_q = question_side(a, base_attn, c_mask)
        return (granularities(p_layers, a, self.hos_order),
                granularities(q_layers, a_q, self.hos_order))

    def forward(self, p_layers: Sequence[Tensor], q_layers: Sequence[Tensor], a: Tensor,
                base_attn: Tensor, c_mask: Tensor, q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``I`` ``[B, Lc, out_dim]`` and the row softmax ``Ĥ`` ``[B, Lc, Lq]``.

        ``p_layers``/``q_layers`` are ``[E, C¹, …, Cⁿ]`` of each side, ``a`` the passage's
        ``A`` and ``base_attn`` the base attention's context-to-query map.
        """
        hos_p, hos_q = self.histories(p_layers, q_layers, a, base_attn, c_mask)  # Eqs. 1-2
        i, attn = self.attention(self.lam_p(hos_p), self.lam_q(hos_q), c_mask, q_mask)  # 3-4
        return self.out(i), attn


def build_aba(widths: Sequence[int], dropout: float, *, aba: bool, lam: str, hos_order: str,
              feed: str, attention_dim: int) -> AdaptiveBiAttention | None:
    """A reader's ABA module (``None`` without ABA); ``attention_dim`` is the width of the base
    attention's output, to which ``I`` is mapped when it is fed there."""
    if not aba:
        return None
    return AdaptiveBiAttention(widths, dropout, lam=lam, hos_order=hos_order, feed=feed,
                               out_dim=attention_dim if feed == "attention" else None)


class ABAReader(nn.Module):
    """What the chapter's base readers (BiDAF++, QANet, SAN) share around their own layers: the
    no-answer option, the optional ABA module ``self.aba``, the two places it is fed, the
    outputs and the chapter's payload. A reader calls :meth:`init_aba` in ``__init__``, has
    ``attn_proj`` (its base attention's projection) and, in ``forward``, passes its attention
    output through :meth:`at_attention`, its output layer's input through :meth:`at_output`
    and returns :meth:`outputs`."""

    def init_aba(self, widths: Sequence[int], dropout: float, *, no_answer: str, aba: bool,
                 aba_lam: str, aba_order: str, aba_feed: str, attention_dim: int,
                 output_dim: int) -> int:
        """Check ``no_answer`` and build ``self.aba`` (:func:`build_aba`; ``widths`` of
        ``[E, C¹, …, Cⁿ, A]``). Returns the width the output layer reads: ``I``'s when ABA is
        fed there, else the base reader's ``output_dim``."""
        check_option("no_answer", no_answer, NO_ANSWERS)
        self.aba = build_aba(widths, dropout, aba=aba, lam=aba_lam, hos_order=aba_order,
                             feed=aba_feed, attention_dim=attention_dim)
        return self.aba.out_dim if self.aba is not None and aba_feed == "output" else output_dim

    def at_attention(self, p_layers, q_layers, g: Tensor, attn: Tensor, c_mask: Tensor,
                     q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The base attention's projected output ``attn_proj(g)`` and map, or, when ABA is fed
        at the attention (``feed="attention"``), ``attn_proj(I)`` and ``Ĥ`` with
        ``A = attn_proj(g)`` as the last granularity."""
        a = self.attn_proj(g)
        if self.aba is None or self.aba.feed != "attention":
            return a, attn
        i, attn = self.aba(p_layers, q_layers, a, attn, c_mask, q_mask)
        return self.attn_proj(i), attn

    def at_output(self, p_layers, q_layers, x: Tensor, attn: Tensor, c_mask: Tensor,
                  q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The output layer's input: ``x`` (the base reader's), or ``I`` with ``A = x`` when ABA
        is fed at the output (``feed="output"``, the paper's), with the map the reader
        reports."""
        if self.aba is None or self.aba.feed != "output":
            return x, attn
        return self.aba(p_layers, q_layers, x, attn, c_mask, q_mask)

    def outputs(self, start: Tensor, end: Tensor, attn: Tensor, batch: dict[str, Tensor],
                na: Tensor | None = None) -> dict[str, Tensor]:
        """The reader's outputs from its masked logits and map: with ``na``, the logit of its
        no-answer head (``no_answer="head"``), else :func:`last_token_outputs`."""
        out = {"attention": attn.float()}
        if na is None:
            return {**out, **last_token_outputs(start, end, batch)}
        return {**out, "start_logits": start, "end_logits": end, "na_logits": na}

    def analysis(self, data, cfg) -> dict:
        """The chapter's payload (:func:`analysis`)."""
        return analysis(self, data, cfg)


# --- unanswerable questions ----------------------------------------------------------------------


def last_token_outputs(start: Tensor, end: Tensor, batch: dict[str, Tensor],
                       max_len: int | None = None) -> dict[str, Tensor]:
    """The paper's unanswerable questions (Sec. 2.1): the answer of an unanswerable question is
    the passage's last token.

    ``start``/``end`` are the reader's masked logits ``[B, Lc]``. Returns

    * ``loss``: the span negative log-likelihood over every example, an unanswerable one
      pointing both ends at its passage's last token (when the batch has targets);
    * ``start_logits``/``end_logits`` with the last token masked, so that decoding picks a real
      span (the last token is reserved for "no answer");
    * ``na_logits``: ``log p¹(last) p²(last) − log max p¹(i) p²(j)`` over the passage's other
      spans ``i ≤ j`` (``j − i < max_len`` with a ``max_len``; by default every span, as the
      bases' papers decode), whose sigmoid is the no-answer probability that the SQuAD 2.0
      threshold acts on.
    """
    c_mask = batch["c_mask"]
    last = c_mask.sum(dim=1) - 1
    out = {}
    if "y1" in batch:
        has = batch["has_answer"]
        out["loss"] = span_loss(start, end, batch["y1"].where(has, last),
                                batch["y2"].where(has, last))
    spans = c_mask & (torch.arange(c_mask.shape[1], device=c_mask.device) != last[:, None])
    log_p1, log_p2 = start.log_softmax(-1), end.log_softmax(-1)
    p1, p2 = (log_p.exp().masked_fill(~spans, 0.0) for log_p in (log_p1, log_p2))
    best = decode_span(p1, p2, max_len or c_mask.shape[1])[2].clamp_min(torch.finfo(p1.dtype).tiny)
    rows = torch.arange(len(last), device=last.device)
    out["na_logits"] = log_p1[rows, last] + log_p2[rows, last] - best.log()
    out["start_logits"], out["end_logits"] = mask_logits(start, spans), mask_logits(end, spans)
    return out


# --- the analysis payload -------------------------------------------------------------------------


def example_picks(split) -> list[int]:
    """Fixed examples for the figures: the unanswerable and the answerable question of ``split``
    with the shortest passage (the first of each kind on ties)."""
    lengths = split.context_lengths()
    has = split.a["has_answer"][split.index].astype(bool)
    return [int(c[lengths[c].argmin()]) for c in (np.flatnonzero(~has), np.flatnonzero(has))
            if len(c)]


def rounded(x: Tensor, digits: int = 4) -> list:
    return np.round(x.detach().double().cpu().numpy(), digits).tolist()


def granularity_shares(lam_module: nn.Module, hos: Sequence[Tensor], mask: Tensor) -> list[float]:
    """Each granularity's share of ``ĤOS``: the mean norm of ``λ_k ⊙ HOS_k`` over the real
    words, normalised to sum to 1."""
    norms = torch.stack([t.norm(dim=-1)[mask].mean() for t in lam_module.terms(hos)])
    return rounded(norms / norms.sum().clamp_min(torch.finfo(norms.dtype).tiny))


def analysis(reader: nn.Module, data, cfg) -> dict:
    """The chapter's payload (averaged weights, eval mode, no gradients): the SQuAD 2.0 protocol
    scores when ``data`` has the protocol's two dev halves (threshold tuned on ``data.adapt``,
    scores on ``data.eval``: :func:`mrc_lib.data.squad2.tuned_scores` with the run's ``cfg``),
    the attention map of a few fixed dev examples, and for ABA readers ``λ`` and each
    granularity's share of ``ĤOS`` on those examples."""
    from mrc_lib.data.squad2 import tuned_scores

    device = next(reader.parameters()).device
    split = data.splits["dev"]
    payload = {}
    if getattr(data, "eval", None) is not None:
        payload["scores"] = tuned_scores(reader, data, cfg, device)
    picks = example_picks(split)
    seen = []
    hook = (reader.aba.register_forward_hook(lambda _, args, __: seen.append(args))
            if reader.aba is not None else None)
    batch = to_device(split.collate(np.array(picks)), device)
    out = reader(batch)
    if hook is not None:
        hook.remove()
    payload["examples"] = []
    for b, i in enumerate(picks):
        n, m = int(batch["c_mask"][b].sum()), int(batch["q_mask"][b].sum())
        payload["examples"].append({
            "index": i, "has_answer": bool(batch["has_answer"][b]),
            "passage": split.tokens(i), "question": split.tokens(i, "q"),
            "attention": rounded(out["attention"][b, :n, :m]),
            "na_prob": round(float(out["na_logits"][b].detach().float().sigmoid()), 4)})
    if hook is not None:
        payload["lambda"] = lambda_summary(reader.aba, seen[0])
    return payload


def lambda_summary(aba: AdaptiveBiAttention, args) -> dict:
    """``λ`` per granularity (mean of its column) and each granularity's share of ``ĤOS``."""
    p_layers, q_layers, a, base_attn, c_mask, q_mask = args
    hos_p, hos_q = aba.histories(p_layers, q_layers, a, base_attn, c_mask)
    return {"granularities": granularity_names(len(p_layers) - 1, aba.hos_order),
            "form": "shared_scalar" if isinstance(aba.lam_p, SharedScalarLambda) else "paper",
            "lambda_p": [round(float(b.mean()), 4) for b in aba.lam_p.blocks()],
            "lambda_q": [round(float(b.mean()), 4) for b in aba.lam_q.blocks()],
            "share_p": granularity_shares(aba.lam_p, hos_p, c_mask),
            "share_q": granularity_shares(aba.lam_q, hos_q, q_mask)}
