"""An ordinary single-process training script: the "before" of docs/porting.md.

A small CNN with BatchNorm and dropout learns a synthetic ten-class image
set; a DataLoader with two worker processes; AdamW with a OneCycleLR
schedule; gradient clipping; an evaluation every 50 steps; the model saved.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

STEPS = 300


class Shapes(Dataset):
    """Ten classes of 12x12 images: a class pattern plus noise, flipped at random."""

    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        patterns = torch.randn(10, 1, 12, 12, generator=generator)
        self.labels = torch.randint(0, 10, (size,), generator=generator)
        noise = torch.randn(size, 1, 12, 12, generator=generator)
        self.images = patterns[self.labels] + 0.8 * noise

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, self.labels[index]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16 * 6 * 6, 10))

    def forward(self, images):
        return self.head(self.features(images).flatten(1))


@torch.no_grad()
def evaluate(model, data):
    model.eval()
    loss = F.cross_entropy(model(data.images), data.labels).item()
    model.train()
    return loss


def main():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS)
    train = DataLoader(Shapes(3000, seed=1), batch_size=48, shuffle=True, num_workers=2)
    validation = Shapes(256, seed=2)

    step = 0
    while step < STEPS:
        for images, labels in train:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if step % 50 == 0:
                validation_loss = evaluate(model, validation)
                print(f"step {step} loss {loss.item():.4f} validation {validation_loss:.4f}",
                      flush=True)
            step += 1
            if step == STEPS:
                break
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
