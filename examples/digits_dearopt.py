"""Train a small CNN on scikit-learn's digits: digits_single.py on one process; digits_dearopt.py is the same
script plus four lines, on any number of ranks (tests/test_examples.py checks both)."""

import dearopt
import torch
from sklearn.datasets import load_digits
from torch import nn

dearopt.init()
torch.manual_seed(0)
torch.set_num_threads(1)
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
x_train, y_train = x[order[:1400]], y[order[:1400]]
x_test, y_test = x[order[1400:]], y[order[1400:]]
x_train, y_train = x_train[dearopt.rank() :: dearopt.size()], y_train[dearopt.rank() :: dearopt.size()]

model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1),
    nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Flatten(),
    nn.Linear(32 * 4 * 4, 64),
    nn.ReLU(),
    nn.Linear(64, 10),
)
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
optimizer = dearopt.DistOptim(optimizer, model)
batch_size, epochs = 32, 8

for epoch in range(epochs):
    model.train()
    perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
    for start in range(0, len(perm) - batch_size + 1, batch_size):
        idx = perm[start : start + batch_size]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"epoch {epoch}: loss {loss.item():.4f} test accuracy {100 * accuracy:.2f}%", flush=True)
print(f"final test accuracy: {100 * accuracy:.2f}%")
