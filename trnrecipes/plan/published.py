"""Where a recipe trains otherwise than the run behind the throughput it quotes (cluster.throughput_config, as the
source states it): plan prints each difference beside the number, so a quoted figure never stands for a
configuration it was not measured with. Torch-free."""

from __future__ import annotations

from dataclasses import fields

from trnrecipes.config.sections import PublishedConfig, Recipe

NOT_PUBLISHED = "not published"


def recipe_values(r: Recipe) -> dict[str, str]:
    """The recipe's value of each PublishedConfig field, spelled as the config spells it."""

    def word(value: object) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    values = {
        "sdk": r.cluster.neuron_sdk,
        "precision": r.precision.dtype,
        "stochastic_rounding": r.precision.stochastic_rounding,
        "attention": getattr(r.model, "attention", "sdpa"),
        "optlevel": r.compile.optlevel,
        "mixed_precision_accumulation": r.compile.mixed_precision_accumulation,
        "tp": r.layout.tp,
        "pp": r.layout.pp,
        "zero1": r.layout.zero1,
        "sequence_parallel": r.layout.sequence_parallel,
        "activation_checkpointing": getattr(r.model, "activation_checkpointing", "none"),
        "seq_len": r.batch.seq_len,
        "global_batch": r.batch.global_batch,
    }
    return {name: word(value) for name, value in values.items()}


def differences(r: Recipe) -> list[tuple[str, str, str]]:
    """(field, the recipe's value, the source's) for every recorded field the recipe trains otherwise."""
    published: PublishedConfig | None = r.cluster.throughput_config
    if published is None:
        return []
    ours = recipe_values(r)
    out = []
    for f in fields(PublishedConfig):
        theirs = getattr(published, f.name)
        if theirs is not None and theirs != NOT_PUBLISHED and str(theirs).lower() != ours[f.name]:
            out.append((f.name, ours[f.name], str(theirs)))
    return out


def published_rows(r: Recipe) -> list[tuple[str, str]]:
    """The plan's rows about the quoted run's configuration: what was recorded of it, and each difference."""
    published = r.cluster.throughput_config
    if published is None or r.cluster.tokens_per_s_per_node is None:
        return []
    stated = [f"{f.name} {getattr(published, f.name)}" for f in fields(PublishedConfig) if getattr(published, f.name)]
    rows = [("as measured", "; ".join(stated))]
    found = differences(r)
    if found:
        rows.append(("differs", "from the source in: " + "; ".join(f"{k} {o} (source {t})" for k, o, t in found)))
    else:
        rows.append(("differs", "in nothing recorded: this recipe trains as the quoted run did"))
    return rows
