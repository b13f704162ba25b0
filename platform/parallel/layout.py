"""Which slice of every sharded dimension a tensor-parallel rank holds.

Megatron-style split over `size` ranks:

    q heads     contiguous ranges, whole kv groups kept together (rank r's query heads
                all read kv heads it holds), so attention needs no communication
    kv heads    ranges of kv heads; when there are fewer kv heads than ranks, each kv
                head is replicated on size / Hkv consecutive ranks, which split its group
    MLP         contiguous ranges of the intermediate dimension
    vocab       contiguous ranges of the vocabulary (embedding rows, LM head rows)

Uneven splits are allowed (e.g. 3 kv heads over 2 ranks: 2 + 1), so any model runs at
any size that splits its heads: kv groups over ranks, or ranks over kv heads with each
group's query heads dividing evenly. Every range is (start, size) in global units.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.arch import ModelArch


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` units go to `parts` ranks, the first
    total % parts ranks taking one more."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    @classmethod
    def create(cls, arch: ModelArch, rank: int, size: int) -> TPLayout:
        """The layout of `rank` out of `size`; ValueError when the heads cannot be split."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} out of tensor_parallel_size {size}")
        num_heads, num_kv_heads = arch.num_heads, arch.num_kv_heads
        groups = num_heads // num_kv_heads
        if num_kv_heads >= size:
            kv_start, kv_count = split(num_kv_heads, size, rank)
            q_heads = (kv_start * groups, kv_count * groups)
            kv_heads = (kv_start, kv_count)
        else:
            sharing = size // num_kv_heads
            if size % num_kv_heads or groups % sharing:
                raise ValueError(
                    f"tensor_parallel_size {size} cannot split {num_kv_heads} kv heads of "
                    f"{groups} query heads each: use a size that divides {num_kv_heads}, "
                    f"or a multiple of it whose share divides {groups}"
                )
            kv_head = rank // sharing
            per_rank = groups // sharing
            q_heads = (kv_head * groups + (rank % sharing) * per_rank, per_rank)
            kv_heads = (kv_head, 1)
        if size > arch.intermediate_size or size > arch.vocab_size:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's dimensions")
        return cls(
            rank=rank,
            size=size,
            q_heads=q_heads,
            kv_heads=kv_heads,
            intermediate=split(arch.intermediate_size, size, rank),
            vocab=split(arch.vocab_size, size, rank),
            head_dim=arch.head_dim,
        )

    @classmethod
    def single(cls, arch: ModelArch) -> TPLayout:
        return cls.create(arch, 0, 1)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1]

    @property
    def q_rows(self) -> tuple[int, int]:
        """Rows of q_proj (columns of o_proj) this rank holds."""
        return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        """Rows of k_proj / v_proj this rank holds."""
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim

    @property
    def sharded(self) -> bool:
        return self.size > 1
