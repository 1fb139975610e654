"""The whole GPT trained under context parallelism against the single-device oracle (issue 31), shared
by the parity and checkpoint tests of this folder.

Data: a global batch of packed samples whose EOD token is 0, built so that the hard cases of
document masking occur (a document crossing chunk borders, a document of length 1, a sample without
an EOD, a sample of EODs only). Loss mask: EOD tokens masked (--eod-mask-loss), so the CP ranks
hold different numbers of kept tokens and the token weighting is tested.

The CP run goes through the trainer's own split (``pretrain.token_split``) and the ZeRO engine over
DP x CP; the oracle is ``ReferenceGPT`` (models/gpt/reference.py) on one device with
torch.optim.AdamW, run on the whole samples (causal) or on each document alone (document masking:
positions from 0, attention inside the document). Each step's loss is the mean of its micro-batches' token-weighted means, as
the trainer defines it.
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt import sharding
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT
from pretrain.token_split import model_loss, split_micro_batch

STEPS, BATCH, SEQ, EOD = 5, 4, 16, 0
# eps 1e-4: the attention key bias has an exactly-zero gradient whose rounding noise AdamW with
# eps 1e-8 would amplify (tests/zero/test_stages.py's GPTTask says why)
ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)


def config(rope: bool = False) -> GPTConfig:
    extra = dict(position_embedding_type="rope") if rope else {}
    return GPTConfig(2, 32, 4, vocab_size=101, seq_length=SEQ, hidden_dropout=0.0,
                     attention_dropout=0.0, make_vocab_size_divisible_by=4, **extra)


def document_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Contract 2: the document of token t is the number of EODs strictly before t."""
    eod = (tokens == EOD).long()
    return torch.cumsum(eod, dim=1) - eod


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 after each EOD (--reset-position-ids)."""
    docs = document_ids(tokens)
    index = torch.arange(tokens.size(1)).expand_as(tokens)
    starts = torch.zeros_like(tokens)
    for b in range(tokens.size(0)):   # the first index of each token's document
        first = {}
        for t in range(tokens.size(1)):
            first.setdefault(int(docs[b, t]), t)
            starts[b, t] = first[int(docs[b, t])]
    return index - starts


def packed_batches(steps: int = STEPS, seed: int = 5, documents: bool = True) -> list[dict]:
    """``steps`` global batches [BATCH, SEQ] with the hard cases (module docstring); with
    ``documents`` also their position and document ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(1, 101, (BATCH, SEQ + 1), generator=g)
        tokens[0, [5, 6]] = EOD            # docs 0..5, {6} (length 1), 7..15 (crosses borders 8, 12)
        tokens[2, :] = EOD                 # all EOD; sample 1 has none
        tokens[3, torch.randint(0, SEQ, (3,), generator=g)] = EOD
        batch = {"tokens": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}
        batch["loss_mask"] = (batch["tokens"] != EOD).float()
        if documents:
            batch["position_ids"] = position_ids(batch["tokens"])
            batch["document_ids"] = document_ids(batch["tokens"])
        out.append(batch)
    return out


def slices(n: int) -> list[slice]:
    """The global batch cut into ``n`` micro-batches (DP rank major, then accumulation step)."""
    per = BATCH // n
    return [slice(i * per, (i + 1) * per) for i in range(n)]


def micro(batch: dict, s: slice) -> dict:
    return {k: v[s] for k, v in batch.items()}


def per_token_by_document(model, tokens: torch.Tensor, labels: torch.Tensor,
                          docs: torch.Tensor) -> torch.Tensor:
    """Per-token loss [b, s] of packed samples with each document run alone through ``model``
    (positions from 0, attention inside the document): what document masking must equal."""
    rows = []
    for b in range(tokens.size(0)):
        parts = []
        for d in torch.unique_consecutive(docs[b]).tolist():
            where = (docs[b] == d).nonzero().flatten()
            lo, hi = int(where[0]), int(where[-1]) + 1
            parts.append(model(tokens[b:b + 1, lo:hi], labels[b:b + 1, lo:hi])[0])
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def reference_run(data: list[dict], micro_batches: int, documents: bool, rope: bool = False):
    """The oracle (module docstring): (losses, grad norms, {canonical name: parameter})."""
    model = ReferenceGPT(config(rope))
    model.init_weights(11)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
                            weight_decay=ADAMW.weight_decay)
    losses, norms = [], []
    for batch in data:
        opt.zero_grad()
        total = 0.0
        for s in slices(micro_batches):
            mb = micro(batch, s)
            if documents:
                per_token = per_token_by_document(model, mb["tokens"], mb["labels"],
                                                  mb["document_ids"])
            else:
                per_token = model(mb["tokens"], mb["labels"])
            mask = mb["loss_mask"]
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0) / micro_batches
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))
        opt.step()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.state_dict().items()}


def cp_state(world: int, tp: int, cp: int, pp: int = 1) -> ParallelState:
    return ParallelState.initialize(Topology(world, tp, gpus_per_node=world, cp=cp,
                                             pipeline_parallel_size=pp))


def cp_train(state: ParallelState, data: list[dict], *, stage: int, comm_type: str,
             documents: bool, accum: int = 1, rope: bool = False):
    """Train the TP x CP x DP model on ``data`` (their position / document ids used when
    ``documents``): (model, engine, losses, grad norms)."""
    model = GPTModel(config(rope), state, device="meta")
    if stage == 3:   # each rank initialises its partitions (the seeded canonical init)
        engine = build_zero_optimizer(model, state, ZeroConfig(stage=3, gradient_accumulation_steps=accum),
                                      ADAMW, seed=11)
    else:
        model.init_weights(11)
        engine = build_zero_optimizer(model, state, ZeroConfig(
            stage=stage, bucket_size=300, gradient_accumulation_steps=accum), ADAMW)
    keep = None if documents else ("tokens", "labels", "loss_mask")
    losses, norms = [], []
    for batch in data:
        engine.zero_grad()
        total = torch.zeros(1, dtype=torch.float64)
        for s in slices(state.dp_size * accum)[state.dp_rank * accum:(state.dp_rank + 1) * accum]:
            mine = {k: v for k, v in micro(batch, s).items() if keep is None or k in keep}
            loss = model_loss(model, split_micro_batch(mine, state, comm_type)) / accum
            engine.backward(loss)
            total += loss.detach().double()
        norms.append(float(engine.step().grad_norm))
        with comm.unrecorded(state.world):   # the CP shares and the DP micro-batch means
            comm.all_reduce(total, state.dp_cp)
        losses.append(total.item() / state.dp_size)
    return model, engine, losses, norms


def local_parameters(model, engine) -> dict[str, torch.Tensor]:
    """This rank's TP-local parameters, whole (stage 3 gathers its partitions)."""
    gathered = getattr(engine, "gathered_state_dict", None)
    if engine.stage == 3 and gathered is not None:
        return {k: v.float() for k, v in gathered().items()}
    return {n: p.detach().float() for n, p in model.named_parameters()}


def assert_matches(state: ParallelState, params: dict, losses, norms, ref, what: str,
                   rtol: float = 1e-5, atol: float = 1e-6, rope: bool = False) -> None:
    ref_losses, ref_norms, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} grad norms: {m}")
    for name, p in params.items():
        expected = sharding.shard_tensor(config(rope), name, ref_params[name], state.tp_rank,
                                         state.tp_size)
        torch.testing.assert_close(p, expected, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} param {name}: {m}")
