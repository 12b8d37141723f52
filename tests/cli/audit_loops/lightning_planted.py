"""A planted-sync Lightning module, trained by the real ``lightning.Trainer`` on the CPU.

Lightning moves each batch with ``.to(device)`` in its own code, and at the end of ``fit`` its
strategy's teardown moves the model back to the host (``module.cpu()``): reads made inside
Lightning are attributed to the ``trainer.fit`` line, with the library line under it. The
``self.log`` calls read nothing here (no logger, no progress bar). Every line that syncs on a GPU
ends with a ``SYNC`` comment; ``batchtap audit`` must list exactly these.
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.val_losses = []
        self.worst = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("train_loss", loss)
        self.log("train_acc", acc)
        self.worst = max(self.worst, loss.item())  # SYNC
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("val_loss", loss)
        self.val_losses.append(loss.cpu())  # SYNC

    def on_validation_epoch_end(self):
        hits = torch.stack(self.val_losses)
        self.val_losses.clear()
        if (hits > 5).any():
            print("high validation loss")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
train = DataLoader(data, batch_size=8, shuffle=True)
val = DataLoader(data, batch_size=16)
trainer = L.Trainer(
    max_epochs=2, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
)
trainer.fit(Classifier(), train_dataloaders=train, val_dataloaders=val)  # SYNC: teardown moves the model to the host (module.cpu())
print("fitted", trainer.global_step)
