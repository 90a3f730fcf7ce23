"""The overlap GEMM's tile order (cpp/include/flux_jax/tile_order.h), checked on CPU.

The CUDA scheduler maps the persistent kernel's linear tile ids through this same function, so a
tile computed twice or never (a wrong answer), or the rank's own rows not going first (lost
overlap), would show here without a GPU.
"""

import itertools
import random

import pytest

from flux_jax import _native


def order(tiles_m, tiles_n, group, rotate, serpentine=False):
    return _native.extension().grouped_tile_order(tiles_m, tiles_n, group, rotate, serpentine)


CASES = list(itertools.product((1, 2, 3, 7, 8, 16, 20), (1, 3, 12, 56), (1, 2, 4, 8, 16)))


@pytest.mark.parametrize("tiles_m,tiles_n,group", CASES)
def test_every_tile_exactly_once(tiles_m, tiles_n, group):
    for rotate in sorted({0, min(1, tiles_m - 1), tiles_m // 2, tiles_m - 1}):
        tiles = order(tiles_m, tiles_n, group, rotate)
        assert sorted(tiles) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


@pytest.mark.parametrize("tiles_m,tiles_n,group", CASES)
def test_groups_sweep_n_and_start_at_the_rotated_rows(tiles_m, tiles_n, group):
    rotate = tiles_m // 2
    tiles = order(tiles_m, tiles_n, group, rotate)
    assert tiles[0] == (rotate, 0)  # rank r's first tile is its own first row tile
    for start in range(0, tiles_m, group):
        rows = min(group, tiles_m - start)
        block = tiles[start * tiles_n : (start + rows) * tiles_n]
        expected_rows = {(start + i + rotate) % tiles_m for i in range(rows)}
        assert {m for m, _ in block} == expected_rows  # one group of row tiles at a time
        assert [n for _, n in block] == [i // rows for i in range(rows * tiles_n)]  # column by column


@pytest.mark.parametrize("tiles_m,tiles_n,group", CASES)
def test_serpentine_reverses_the_odd_groups_columns(tiles_m, tiles_n, group):
    """Serpentine: the same groups in the same order, every tile once; the even groups sweep N as
    the plain order does, the odd ones backwards, so each odd group starts on the columns the group
    before it read last (and each even one after the first on those its odd predecessor read last)."""
    for rotate in sorted({0, tiles_m // 2, tiles_m - 1}):
        plain = order(tiles_m, tiles_n, group, rotate)
        snake = order(tiles_m, tiles_n, group, rotate, serpentine=True)
        assert sorted(snake) == sorted(plain)
        for g, start in enumerate(range(0, tiles_m, group)):
            span = slice(start * tiles_n, (start + min(group, tiles_m - start)) * tiles_n)
            assert [m for m, _ in snake[span]] == [m for m, _ in plain[span]]
            flip = (lambda n: tiles_n - 1 - n) if g % 2 else (lambda n: n)
            assert [n for _, n in snake[span]] == [flip(n) for _, n in plain[span]]
            if g > 0:
                assert snake[span][0][1] == snake[span.start - 1][1]  # the turn: no new column


def test_serpentine_picture():
    """The header's picture: group 2, tiles_n 4."""
    snake = order(4, 4, 2, 0, serpentine=True)
    grid = [[snake.index((m, n)) for n in range(4)] for m in range(4)]
    assert grid == [[0, 2, 4, 6], [1, 3, 5, 7], [14, 12, 10, 8], [15, 13, 11, 9]]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rotate < tiles_m"):
        order(4, 4, 2, 4)
    with pytest.raises(ValueError, match="group >= 1"):
        order(4, 4, 0, 0)


CLUSTER_CASES = list(itertools.product((1, 2, 3, 7, 8, 16, 20), (1, 3, 12, 56), (1, 2, 8), (1, 2)))


def clustered(tiles_m, tiles_n, group, rotate, cluster_m, cluster_n=1, serpentine=False):
    return _native.extension().clustered_tile_order(tiles_m, tiles_n, group, rotate, cluster_m, cluster_n, serpentine)


@pytest.mark.parametrize("tiles_m,tiles_n,group,cluster_m", CLUSTER_CASES)
def test_clusters_cover_every_padded_tile_once_and_share_n(tiles_m, tiles_n, group, cluster_m):
    """2x1 clusters (the CTAs share B by multicast): every tile of M padded to whole clusters
    exactly once, the CTAs of one cluster on adjacent row tiles of the same n, the rank's own
    cluster row first; cluster_m = 1 is the plain grouped order."""
    padded = -(-tiles_m // cluster_m) * cluster_m
    for rotate in sorted({0, min(1, tiles_m - 1), tiles_m // 2, tiles_m - 1}):
        tiles = clustered(tiles_m, tiles_n, group, rotate, cluster_m)
        assert sorted(tiles) == [(m, n) for m in range(padded) for n in range(tiles_n)]
        for i in range(0, len(tiles), cluster_m):
            cluster = tiles[i : i + cluster_m]
            assert len({n for _, n in cluster}) == 1
            assert [m for m, _ in cluster] == list(range(cluster[0][0], cluster[0][0] + cluster_m))
            assert cluster[0][0] % cluster_m == 0
        assert tiles[0] == (rotate // cluster_m * cluster_m, 0)
        if cluster_m == 1:
            assert tiles == order(tiles_m, tiles_n, group, rotate)


@pytest.mark.parametrize("tiles_m,tiles_n,group", CASES)
def test_column_clusters_cover_every_padded_tile_once_and_share_m(tiles_m, tiles_n, group):
    """1x2 clusters (the CTAs share A by multicast, so they must wait for the same rows): every
    tile of N padded to whole clusters exactly once, the CTAs of one cluster on adjacent column
    tiles of the same m, and the cluster order is the grouped order over cluster columns, so the
    rank's own rows go first at any rotation."""
    padded = -(-tiles_n // 2) * 2
    for rotate in sorted({0, min(1, tiles_m - 1), tiles_m // 2, tiles_m - 1}):
        tiles = clustered(tiles_m, tiles_n, group, rotate, 1, 2)
        assert sorted(tiles) == [(m, n) for m in range(tiles_m) for n in range(padded)]
        pairs = [tiles[i : i + 2] for i in range(0, len(tiles), 2)]
        for (m0, n0), (m1, n1) in pairs:
            assert m0 == m1 and n0 % 2 == 0 and n1 == n0 + 1
        assert [(m, n // 2) for (m, n), _ in pairs] == order(tiles_m, padded // 2, group, rotate)


@pytest.mark.parametrize("tiles_m,tiles_n,group,cluster_m", CLUSTER_CASES)
def test_serpentine_clusters(tiles_m, tiles_n, group, cluster_m):
    """Serpentine over clusters: along M, the clusters keep their CTAs on one n and the tiles are the
    plain order's, each once; along N, the clusters sweep the serpentine order over cluster columns."""
    for rotate in sorted({0, tiles_m // 2, tiles_m - 1}):
        plain = clustered(tiles_m, tiles_n, group, rotate, cluster_m)
        snake = clustered(tiles_m, tiles_n, group, rotate, cluster_m, serpentine=True)
        assert sorted(snake) == sorted(plain)
        for i in range(0, len(snake), cluster_m):
            assert len({n for _, n in snake[i : i + cluster_m]}) == 1
        if cluster_m == 1:
            assert snake == order(tiles_m, tiles_n, group, rotate, serpentine=True)
        cols = clustered(tiles_m, tiles_n, group, rotate, 1, 2, serpentine=True)
        padded = -(-tiles_n // 2) * 2
        assert [(m, n // 2) for (m, n) in cols[::2]] == order(tiles_m, padded // 2, group, rotate, serpentine=True)


def test_clustered_order_rejects_two_dimensional_clusters():
    with pytest.raises(ValueError, match="one of the cluster"):
        clustered(4, 4, 2, 0, 2, 2)


def test_fast_division_is_exact():
    """The schedulers divide by multiply-and-shift (no integer division on the GPU): exact for every
    numerator in [0, 2^31) and divisor in [1, 2^31), checked at the edges and at random."""
    divide = _native.extension().fast_divide
    rng = random.Random(0)
    divisors = [1, 2, 3, 5, 7, 8, 12, 56, 160, 255, 256, 257, 1000, 4097, 65535, 65536, 65537]
    divisors += [2**30 - 1, 2**30, 2**30 + 1, 2**31 - 1] + [rng.randrange(1, 2**31) for _ in range(200)]
    for d in divisors:
        numerators = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2**31 - 1, 2**31 - 2] + [
            rng.randrange(0, 2**31) for _ in range(200)
        ]
        numerators = [n for n in numerators if 0 <= n < 2**31]
        assert divide(numerators, d) == [n // d for n in numerators], d
