"""DecaProp: Densely Connected Attention Propagation for Reading Comprehension (Tay, Luu, Hui &
Su, NeurIPS 2018).

The idea: bidirectional attention between any two layers, compressed to three scalars per word by
factorization machines, is cheap enough to connect *every* passage layer with *every* query layer.

* the input encoder (Sec. 3.1), :class:`~mrc_lib.models.rnet.InputEncoder`: word vectors, a
  character BiRNN and two features, ``d_w + h_c + 2`` per token;
* :class:`FactorizationMachine` ``G`` (Eq. 4), computed in ``O(nk)``; :class:`MLPCompressor`, the
  linear and nonlinear replacements of the Table 7 ablations (8)-(9);
* :class:`BAC`, the bidirectional attention connector (Sec. 2, Eqs. 1-3);
* :class:`DecaEnc` (Sec. 3.2, Eq. 5): ``n`` BiRNN layers, a same-level BAC between layers whose
  three features feed the next layer, and BACs between every pair of passage and query layers;
* :class:`DecaCore` (Sec. 3.3, Eqs. 6-9): gated attention and gated self-attention
  (:class:`~mrc_lib.models.rnet.MatchingCore`), then one-sided BACs from ``U¹, U²`` to the query
  layers (the dense core);
* the BiRNN pointer (Sec. 3.4, Eqs. 10-11), :class:`~mrc_lib.models.rnet.BiRNNPointer`; the loss
  (Eq. 12) and the decoding ``argmax p¹_k p²_l, k ≤ l`` are the trainer's.

Dropout (Sec. 4.2) acts on the input of every RNN (locked, i.e. variational) and of every dense
layer: the projections ``F``, the compressors ``G``, the gates and the pointer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.models import register
from mrc_lib.models.rnet import Affinity, BiRNNPointer, InputEncoder, MatchingCore
from mrc_lib.nn import RNN, context_to_query, zero_padding

COMPRESSORS = ("fm", "linear", "nonlinear")
CORE_CONNECTORS = ("eq9", "12n")
N_FEATURES = 3  # scalars per word per BAC (Eq. 3)
ANALYSIS_EXAMPLES, ANALYSIS_TOKENS = 2, 40  # the connector figure's dev examples and words


class FactorizationMachine(nn.Module):
    """``G(x) = w₀ + Σᵢ wᵢxᵢ + Σᵢ<ⱼ ⟨vᵢ, vⱼ⟩ xᵢxⱼ`` (Eq. 4), ``R^n → R`` with ``k`` factors.

    The pairwise term is evaluated in ``O(nk)`` (Rendle 2010):
    ``Σᵢ<ⱼ ⟨vᵢ, vⱼ⟩ xᵢxⱼ = ½ Σ_f [(Σᵢ v_if xᵢ)² − Σᵢ v_if² xᵢ²]``.
    """

    def __init__(self, n: int, k: int = 64) -> None:
        super().__init__()
        self.linear = nn.Linear(n, 1)  # w₀, w
        self.V = nn.Parameter(torch.randn(n, k) * 0.01)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., n]`` to ``[...]``."""
        pairs = 0.5 * ((x @ self.V) ** 2 - (x * x) @ (self.V * self.V)).sum(-1)
        return self.linear(x).squeeze(-1) + pairs


class MLPCompressor(nn.Sequential):
    """The FM's replacements in Table 7: ``linear`` ``d → 1`` or ``nonlinear`` ``d → d → 1``
    (the ReLU between is ours: Table 7 names no activation)."""

    def __init__(self, n: int, nonlinear: bool) -> None:
        hidden = [nn.Linear(n, n), nn.ReLU()] if nonlinear else []
        super().__init__(*hidden, nn.Linear(n, 1))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).squeeze(-1)


def build_compressor(kind: str, n: int, k: int) -> nn.Module:
    """``G: R^n → R`` by name: ``fm`` (Eq. 4), ``linear`` or ``nonlinear``."""
    if kind == "fm":
        return FactorizationMachine(n, k)
    if kind in ("linear", "nonlinear"):
        return MLPCompressor(n, nonlinear=kind == "nonlinear")
    raise UserError(f"unknown compressor {kind!r}; choose one of {', '.join(COMPRESSORS)}")


class BAC(nn.Module):
    """Bidirectional attention connector (Sec. 2) between sequences of the same size ``dim``.

    ``E = F(P) F(Q)ᵀ / √d`` (Eq. 1); ``A = Softmax(Eᵀ) P``, ``B = Softmax(E) Q`` (Eq. 2);
    ``g^p_i = [G₁([bᵢ; pᵢ]); G₂(bᵢ − pᵢ); G₃(bᵢ ⊙ pᵢ)]`` and ``g^q_j`` the same with ``aⱼ, qⱼ``
    (Eq. 3). Our readings: one compressor per comparison (Eq. 3 writes one ``G``, but ``[bᵢ; pᵢ]``
    is twice as wide as the others), the three shared by the two directions (the paper says the
    query side is built "in an identical fashion"). Dropout acts on the input of ``F``
    and of each ``G``.
    """

    def __init__(self, dim: int, *, proj_dim: int, k: int = 64, compressor: str = "fm",
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.affinity = Affinity(dim, proj_dim, dropout)
        self.G = nn.ModuleList(build_compressor(compressor, n, k) for n in (2 * dim, dim, dim))
        self.dropout = nn.Dropout(dropout)

    def compress(self, x: Tensor, attended: Tensor, mask: Tensor) -> Tensor:
        """Eq. 3 for one side: ``[B, L, 3]``, zero at padding."""
        inputs = (torch.cat([attended, x], dim=-1), attended - x, attended * x)
        g = torch.stack([G(self.dropout(v)) for G, v in zip(self.G, inputs)], dim=-1)
        return zero_padding(g, mask)

    def forward(self, p: Tensor, q: Tensor, p_mask: Tensor,
                q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(g^p [B, Lp, 3], g^q [B, Lq, 3])``."""
        E = self.affinity(p, q)  # Eq. 1
        B = context_to_query(E, q, q_mask)  # Eq. 2, passage side
        A = context_to_query(E.transpose(1, 2), p, p_mask)  # Eq. 2, query side
        return self.compress(p, B, p_mask), self.compress(q, A, q_mask)

    def one_sided(self, p: Tensor, q: Tensor, p_mask: Tensor, q_mask: Tensor) -> Tensor:
        """``F'_C`` of Eq. 9: the left sequence's ``g^p`` only."""
        return self.compress(p, context_to_query(self.affinity(p, q), q, q_mask), p_mask)


class DecaEnc(nn.Module):
    """Densely connected attention encoder (Sec. 3.2).

    ``n`` BiRNN layers shared by passage and query. Layer ``i`` reads ``[Pⁱ⁻¹; BACⁱ⁻¹]``: the
    previous states and the three features of the same-level BAC between ``Pⁱ⁻¹`` and ``Qⁱ⁻¹``
    (sizes ``d → 2h → 2h+3 → 2h ...``, the paper's ``d → h → h+3 → h`` with ``h`` the BiRNN's
    output size). Eq. 5 connects ``Pⁱ`` with ``Qʲ`` for every pair ``(i, j)``; our reading: the
    same-level BACs are its pairs ``(i, i)``, giving the paper's ``3n²`` features per word on each
    side. Output: ``[P¹; ...; Pⁿ; Z]``, ``nh + 3n²`` features (and the same for the query).

    ``dense=False`` (Table 7, ablation 3) is a plain ``n``-layer BiRNN whose output is its top
    layer; ``cross_hierarchy=False`` (ablation 4) keeps only the ``3n`` same-level features.
    """

    def __init__(self, input_size: int, hidden: int, *, n_layers: int = 3, dense: bool = True,
                 cross_hierarchy: bool = True, proj_dim: int, k: int = 64,
                 compressor: str = "fm", cell: str = "gru", dropout: float = 0.0) -> None:
        super().__init__()
        self.dense, self.n_layers = dense, n_layers
        extra = N_FEATURES if dense else 0
        self.layers = nn.ModuleList(
            RNN(input_size if i == 0 else 2 * hidden + extra, hidden, cell=cell, dropout=dropout)
            for i in range(n_layers))
        self.pairs = ([(i, j) for i in range(n_layers) for j in range(n_layers)
                       if cross_hierarchy or i == j] if dense else [])
        self.bacs = nn.ModuleDict({
            f"{i}_{j}": BAC(2 * hidden, proj_dim=proj_dim, k=k, compressor=compressor,
                            dropout=dropout)
            for i, j in self.pairs})
        self.out_dim = (2 * hidden * n_layers + N_FEATURES * len(self.pairs) if dense
                        else 2 * hidden)

    def forward(self, p: Tensor, q: Tensor, p_mask: Tensor, q_mask: Tensor):
        """Returns the outputs ``(P', Q')``, the layer states ``([P¹..Pⁿ], [Q¹..Qⁿ])`` and the
        connector features ``(Z_p [B, Lp, pairs, 3], Z_q [B, Lq, pairs, 3])`` (``None`` when
        ``dense=False``)."""
        ps, qs, z = [], [], {}
        for i, rnn in enumerate(self.layers):
            if i and self.dense:  # [Pⁱ⁻¹; BACⁱ⁻¹] feeds layer i
                g_p, g_q = z[i - 1, i - 1]
                p, q = torch.cat([p, g_p], dim=-1), torch.cat([q, g_q], dim=-1)
            p, q = rnn(p, p_mask), rnn(q, q_mask)
            ps.append(p)
            qs.append(q)
            if self.dense:
                z[i, i] = self.bacs[f"{i}_{i}"](p, q, p_mask, q_mask)
        if not self.dense:
            return (ps[-1], qs[-1]), (ps, qs), None
        for i, j in self.pairs:  # cross-hierarchy connectors, Eq. 5
            if i != j:
                z[i, j] = self.bacs[f"{i}_{j}"](ps[i], qs[j], p_mask, q_mask)
        z_p = torch.stack([z[pair][0] for pair in self.pairs], dim=2)
        z_q = torch.stack([z[pair][1] for pair in self.pairs], dim=2)
        p_out = torch.cat([*ps, z_p.flatten(2)], dim=-1)
        q_out = torch.cat([*qs, z_q.flatten(2)], dim=-1)
        return (p_out, q_out), (ps, qs), (z_p, z_q)


class DecaCore(nn.Module):
    """Densely connected core (Sec. 3.3).

    Gated attention of ``P'`` over ``Q'`` gives ``U¹``, gated self-attention ``U²`` (Eqs. 6-8,
    :class:`~mrc_lib.models.rnet.MatchingCore`). The dense core then applies one-sided BACs
    ``Rᵏʲ = F'_C(Uʲ, Qᵏ)`` (Eq. 9) and outputs ``M = [U²; R']``. ``connectors`` picks the
    reading of Eq. 9:

    * ``"eq9"`` (default, Eq. 9 as printed): ``k = 1..n``, ``j = 1, 2``: ``2n`` connectors,
      ``6n`` features;
    * ``"12n"``: the width the text gives, ``M ∈ R^{ℓp × (d + 12n)}``, reached by also connecting
      ``Uʲ`` with the passage layers ``Pᵏ``: ``4n`` connectors, ``12n`` features.

    ``dense=False`` (Table 7, ablation 2) drops the dense core: ``M = U²``. ``attention=False``
    (ablation 5) removes the gated attention layers (see ``MatchingCore``).
    """

    def __init__(self, dim: int, hidden: int, *, n_layers: int = 3, dense: bool = True,
                 connectors: str = "eq9", attention: bool = True, gate: str = "p",
                 proj_dim: int, k: int = 64, compressor: str = "fm", cell: str = "gru",
                 dropout: float = 0.0) -> None:
        super().__init__()
        if connectors not in CORE_CONNECTORS:
            raise UserError(f"unknown core connectors {connectors!r}; choose one of "
                            f"{', '.join(CORE_CONNECTORS)}")
        self.connectors = connectors
        self.match = MatchingCore(dim, hidden, proj_dim=proj_dim, attention=attention, gate=gate,
                                  cell=cell, dropout=dropout)
        sides = 2 if connectors == "12n" else 1
        n_bacs = 2 * sides * n_layers if dense else 0
        self.bacs = nn.ModuleList(
            BAC(2 * hidden, proj_dim=proj_dim, k=k, compressor=compressor, dropout=dropout)
            for _ in range(n_bacs))
        self.out_dim = 2 * hidden + N_FEATURES * n_bacs

    def targets(self, layers: tuple[list[Tensor], list[Tensor]], p_mask: Tensor,
                q_mask: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The right-hand sequences of Eq. 9 with their masks: ``Q¹..Qⁿ`` (and ``P¹..Pⁿ``)."""
        targets = [(x, q_mask) for x in layers[1]]
        if self.connectors == "12n":
            targets += [(x, p_mask) for x in layers[0]]
        return targets

    def forward(self, p: Tensor, q: Tensor, p_mask: Tensor, q_mask: Tensor,
                layers: tuple[list[Tensor], list[Tensor]]) -> tuple[Tensor, Tensor | None]:
        """``M`` ``[B, Lp, out_dim]`` and the passage-to-query attention of ``U¹``."""
        u1, u2, attn = self.match(p, q, p_mask, q_mask)
        pairs = [(u, x, mask) for u in (u1, u2) for x, mask in self.targets(layers, p_mask, q_mask)]
        r = [bac.one_sided(u, x, p_mask, mask)  # Eq. 9
             for bac, (u, x, mask) in zip(self.bacs, pairs)]
        return torch.cat([u2, *r], dim=-1), attn


@register("decaprop")
class DecaProp(nn.Module):
    """The DecaProp reader, with the ablations of Table 7 as switches.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        hidden: ``h``, the BiRNN size per direction.
        n_layers: ``n``, the DecaEnc depth (paper: 3; ablations (6)-(7): 2 and 4).
        factors: ``k``, the FM's latent factors (Eq. 4; paper: 64).
        compressor: ``G`` of Eq. 3: ``fm`` (Eq. 4), or ablations (8) ``linear`` and (9)
            ``nonlinear``.
        use_enc: DecaEnc; ``False`` (ablation 3) uses a plain ``n``-layer BiRNN.
        dense_core: DecaCore's connectors; ``False`` (ablation 2) passes ``U²`` to the pointer.
        cross_hierarchy: connect every pair of layers; ``False`` (ablation 4) only same levels.
        gated_attention: the gated attention layers; ``False`` (ablation 5) lets the input pass
            through them.
        core_connectors: the reading of Eq. 9, ``eq9`` (as printed) or ``12n`` (see
            :class:`DecaCore`).
        gate: what the gate of Eq. 8 scales: ``p`` (as printed) or ``concat`` (R-NET's form,
            see :class:`~mrc_lib.models.rnet.GatedAttention`).
        attention_dim: size of the ReLU projections ``F`` of Eqs. 1 and 6.
        char_dim: character embedding size (paper: 8).
        char_hidden: size per direction of the character BiRNN (paper: that of the word RNNs).
        cell: ``gru`` or ``lstm``.
        dropout: on the input of every RNN (locked) and of every dense layer.
    """

    def __init__(self, vocab, *, hidden: int = 75, n_layers: int = 3, factors: int = 64,
                 compressor: str = "fm", use_enc: bool = True, dense_core: bool = True,
                 cross_hierarchy: bool = True, gated_attention: bool = True,
                 core_connectors: str = "eq9", gate: str = "p", attention_dim: int = 75,
                 char_dim: int = 8, char_hidden: int = 75, cell: str = "gru",
                 dropout: float = 0.2):
        super().__init__()
        bac = dict(proj_dim=attention_dim, k=factors, compressor=compressor, cell=cell,
                   dropout=dropout)
        self.embed = InputEncoder(vocab, char_dim=char_dim, char_hidden=char_hidden, cell=cell,
                                  dropout=dropout)
        self.enc = DecaEnc(self.embed.out_dim, hidden, n_layers=n_layers, dense=use_enc,
                           cross_hierarchy=cross_hierarchy, **bac)
        self.core = DecaCore(self.enc.out_dim, hidden, n_layers=n_layers, dense=dense_core,
                             connectors=core_connectors, attention=gated_attention, gate=gate,
                             **bac)
        self.pointer = BiRNNPointer(self.core.out_dim, hidden, cell=cell, dropout=dropout)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        p, q = self.embed(batch)
        (p, q), layers, _ = self.enc(p, q, c_mask, q_mask)
        m, attn = self.core(p, q, c_mask, q_mask, layers)
        start, end = self.pointer(m, c_mask)
        return {"start_logits": start, "end_logits": end,
                **({"attention": attn.float()} if attn is not None else {})}

    def analysis(self, data, cfg) -> dict:
        """The connector figure's payload: DecaEnc's passage-side features ``Z_p`` (Eq. 5) for
        the first words of the first dev examples, with the layer pairs and the words."""
        split = data.splits["dev"]
        if not self.enc.dense:
            return {}
        picks = np.arange(min(ANALYSIS_EXAMPLES, len(split)))
        device = next(self.parameters()).device
        batch = {k: v.to(device) for k, v in split.collate(picks).items()}
        p, q = self.embed(batch)
        *_, (z_p, _) = self.enc(p, q, batch["c_mask"], batch["q_mask"])
        examples = []
        for b, i in enumerate(picks.tolist()):
            n = min(int(batch["c_mask"][b].sum()), ANALYSIS_TOKENS)
            examples.append({
                "index": i, "question": split.question(i), "tokens": split.tokens(i)[:n],
                "features": np.round(z_p[b, :n].float().cpu().numpy(), 4).tolist(),
                "mean_abs": np.round(z_p[b, :int(batch["c_mask"][b].sum())].abs().mean((0, 2))
                                     .float().cpu().numpy(), 4).tolist()})
        return {"pairs": [list(pair) for pair in self.enc.pairs], "examples": examples}
