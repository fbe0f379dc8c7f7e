"""A test helper: record the layouts `jaxgen/backends/cpu/layer_split.decoding_plan` plans."""


def record_layout_plans(monkeypatch) -> list[dict]:
    """Patch `layer_split.decoding_plan` (for this test) to append every plan it makes to the
    returned list; None (params that stay as they are, or are already laid out) is left out.
    A later call replaces the patch rather than wrapping it."""
    from jaxgen.backends.cpu import layer_split

    real = getattr(layer_split.decoding_plan, "__wrapped__", layer_split.decoding_plan)
    plans = []

    def recording(*args, **kwargs):
        plan = real(*args, **kwargs)
        if plan is not None:
            plans.append(plan)
        return plan

    recording.__wrapped__ = real
    monkeypatch.setattr(layer_split, "decoding_plan", recording)
    return plans
