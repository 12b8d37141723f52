"""A planted-sync copy of a Hugging Face "no trainer" loop (``run_clm_no_trainer.py`` style) on a
tiny GPT-2 built from a config (no download), cut down to run in seconds on a CPU.

Kept from the example: ``default_data_collator`` batches from a shuffled ``DataLoader`` (its
sampler draws a seed with ``.item()`` on the host), ``{k: v.to(device)}``, ``model(**batch).loss``,
``get_scheduler``, ``total_loss += loss.detach().float()``, and the evaluation's
``math.exp(torch.mean(losses))``.

Every line that syncs on a GPU ends with a ``SYNC`` comment; ``batchtap audit`` must list exactly these.
"""

import math

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
seq, vocab, batch_size, epochs = 8, 48, 4, 2
generator = torch.Generator().manual_seed(0)
rows = []
for _ in range(24):
    ids = torch.randint(1, vocab, (seq,), generator=generator).tolist()
    rows.append({"input_ids": ids, "attention_mask": [1] * seq, "labels": ids})
train_dataloader = DataLoader(rows[:16], shuffle=True, collate_fn=default_data_collator, batch_size=batch_size)
eval_dataloader = DataLoader(rows[16:], collate_fn=default_data_collator, batch_size=batch_size)

config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=16, n_layer=1, n_head=2)
model = GPT2LMHeadModel(config)
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=epochs * len(train_dataloader))

tokens = 0
for epoch in range(epochs):
    model.train()
    total_loss = 0
    for step, batch in enumerate(train_dataloader):
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch)  # SYNC: transformers reads the attention mask (masking_utils fast_all)
        loss = outputs.loss
        total_loss += loss.detach().float()
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        tokens += int(batch["attention_mask"].sum())  # SYNC
        if step % 2 == 0:
            print(f"epoch {epoch} step {step}: loss {loss:.4f} lr {lr_scheduler.get_last_lr()[0]:.2e}")  # SYNC

    model.eval()
    losses = []
    for step, batch in enumerate(eval_dataloader):
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad():
            outputs = model(**batch)  # SYNC: the same mask check
        losses.append(outputs.loss.repeat(batch_size))
    losses = torch.cat(losses)
    try:
        perplexity = math.exp(torch.mean(losses))  # SYNC
    except OverflowError:
        perplexity = float("inf")
    print(f"epoch {epoch}: perplexity {perplexity:.2f} train_loss {total_loss.item() / len(train_dataloader):.4f}")  # SYNC
print("tokens", tokens)
