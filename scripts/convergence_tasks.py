"""The two convergence tasks the scripts share (DeFT, issue 16; sparsification, issue 18): scikit-learn's digits
with examples/digits_dearopt.py's CNN, and a character-level GRU language model on Python 3.11's own
``argparse.py``, ``textwrap.py`` and ``string.py`` (nothing is downloaded).  Run on each rank of a spawned job:
:func:`train_digits` and :func:`train_lm` train one model with the optimizer ``make_opt(model)`` returns and give
back the curve; the optimizer's ``step`` is passed the loss (DeFT's Preserver reads it)."""

from __future__ import annotations

import argparse

SEQ, LM_BATCH, EVAL_EVERY = 64, 16, 50


def digits_data():
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[order[:1400]], y[order[:1400]], x[order[1400:]], y[order[1400:]]


def digits_model(seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
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


def text_data():
    """Characters of three stdlib modules of this Python (fixed by its version): 90 % train, 10 % held out."""
    import string
    import textwrap

    import torch

    paths = [argparse.__file__, textwrap.__file__, string.__file__]
    text = "".join(open(p, encoding="utf-8").read() for p in paths)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:], len(vocab)


class CharLM:
    """Embedding, a one-layer GRU, a linear decoder: seven parameters (seven buckets at buffer_size=1)."""

    def __new__(cls, vocab):
        import torch
        from torch import nn

        class CharLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, 48)
                self.rnn = nn.GRU(48, 128, batch_first=True)
                self.head = nn.Linear(128, vocab)

            def forward(self, x):
                return self.head(self.rnn(self.embed(x))[0])

        torch.manual_seed(0)
        return CharLM()


def train_digits(make_opt, epochs: int, rank: int, world: int, batch: int = 32, seed: int = 0, test_loss: list = None):
    """Train the digits CNN on this rank's part of the training set; returns (test accuracy after each epoch [%],
    steps, the optimizer: the caller closes it).  ``seed`` sets the initial weights and the order of the samples
    (0: the scripts' usual run); ``test_loss``, a list, gets the test cross-entropy after each epoch."""
    import torch
    from torch import nn

    x_train, y_train, x_test, y_test = digits_data()
    x_train, y_train = x_train[rank::world], y_train[rank::world]
    model = digits_model(seed)
    opt = make_opt(model)
    accuracy, steps = [], 0
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch + 1000 * seed))
        for start in range(0, len(perm) - batch + 1, batch):
            idx = perm[start : start + batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step(loss=loss.detach())
            steps += 1
        model.eval()
        with torch.no_grad():
            logits = model(x_test)
            accuracy.append(100 * (logits.argmax(1) == y_test).float().mean().item())
            if test_loss is not None:
                test_loss.append(round(float(nn.functional.cross_entropy(logits, y_test)), 4))
    return accuracy, steps, opt


def train_lm(make_opt, steps: int, rank: int, world: int):
    """Train the character LM (LM_BATCH sequences of SEQ characters per rank and step); returns (held-out loss every
    EVAL_EVERY steps, the optimizer: the caller closes it)."""
    import torch
    from torch import nn

    train, held_out, vocab = text_data()
    g = torch.Generator().manual_seed(1)
    eval_starts = torch.randint(0, len(held_out) - SEQ - 1, (64,), generator=g)
    eval_x = torch.stack([held_out[s : s + SEQ] for s in eval_starts])
    eval_y = torch.stack([held_out[s + 1 : s + SEQ + 1] for s in eval_starts])
    model = CharLM(vocab)
    opt = make_opt(model)
    curve = []
    for step in range(steps):
        starts = torch.randint(
            0, len(train) - SEQ - 1, (LM_BATCH * world,), generator=torch.Generator().manual_seed(100 + step)
        )[rank::world]
        x = torch.stack([train[s : s + SEQ] for s in starts])
        y = torch.stack([train[s + 1 : s + SEQ + 1] for s in starts])
        model.train()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step(loss=loss.detach())
        if (step + 1) % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                held = nn.functional.cross_entropy(model(eval_x).reshape(-1, vocab), eval_y.reshape(-1))
            curve.append(round(float(held), 4))
    return curve, opt
