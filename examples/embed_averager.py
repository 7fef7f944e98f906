"""A plain (non-trio) PyTorch script that embeds a DHT node and an averager.

Start several copies by hand on one machine; each trains a tiny linear model on its own data and
averages its parameters with the others every few steps:

    python examples/embed_averager.py                        # prints: started, join with --initial-peer ADDR
    python examples/embed_averager.py --initial-peer ADDR    # in another terminal (repeat for more peers)

Each copy logs the group it averaged with and the spread of its weights shrinking.
"""

from __future__ import annotations

import argparse
import logging

import torch

from averaging import Averager, MatchmakingError
from dht import DHT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peer", action="append", default=[], metavar="ADDR")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--min-group-size", type=int, default=2, help="the fewest peers a round averages with")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    dht = DHT(initial_peers=args.initial_peer, start=True)
    print(f"started, join with --initial-peer {dht.address}", flush=True)

    torch.manual_seed(args.seed if args.seed is not None else int(str(dht.peer_id.to_int())[-6:]))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    true_weights = torch.randn(8, 1)
    averager = Averager(
        list(model.parameters()),
        dht,
        prefix="embed_example",
        target_group_size=args.group_size,
        min_group_size=args.min_group_size,
    )
    for round_number in range(args.rounds):
        for _ in range(10):  # a few local steps on this copy's own data
            x = torch.randn(32, 8)
            loss = torch.nn.functional.mse_loss(model(x), x @ true_weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        try:
            result = averager.step(timeout=10)
            print(f"round {round_number}: averaged with {len(result.group.members)} peers, loss {loss.item():.4f}")
        except MatchmakingError as error:
            print(f"round {round_number}: no group ({error}); training alone, loss {loss.item():.4f}")
        with averager.get_tensors() as tensors:
            print(f"  weight[0] = {tensors[0][0, 0].item():+.4f}")
    averager.shutdown()  # the others stop counting on this copy now, not when its declaration expires
    dht.shutdown()


if __name__ == "__main__":
    main()
