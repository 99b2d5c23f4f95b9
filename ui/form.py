"""The studio's Generate form as one typed object, and the one place a request is built from it.

`StudioForm`'s fields are the controls Generate and Compare read, in the order of their input components
(and so of the `/generate` and `/compare` API parameters): `CONTROL_NAMES` is that order, taken from the
fields, and `form_from_values` is the one function that turns the components' values into a form.
`spec_from_form` turns a form into the job to run. No Gradio here: tests build forms directly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Sequence

from ui.controls import DEFAULT_SEED_TEXT, JobSpec


@dataclass(frozen=True)
class StudioForm:
    """What the controls hold when Generate or Compare is pressed. None = not given (an API call may leave
    any control out): the control's default applies. Values are as Gradio delivers them, unparsed."""

    backend: str | None = None                 # stylegan | diffusion
    model: str | None = None                   # catalogue id or path
    seed: str | None = None                    # StyleGAN: a list ("0-7, 42"); diffusion: one seed, empty = random
    sg_mode: str | None = None                 # images | style-mix | interpolate (the open StyleGAN tab)
    truncation_psi: float | None = None
    truncation_cutoff: str | None = None
    noise_mode: str | None = None
    class_index: str | None = None
    sg_batch_size: float | None = None
    mix_rows: str | None = None
    mix_cols: str | None = None
    mix_from: float | None = None
    mix_to: float | None = None
    frames_per_seed: float | None = None
    interp_space: str | None = None
    animation_format: str | None = None
    fps: float | None = None
    prompt: str | None = None
    negative_prompt: str | None = None
    steps: float | None = None
    guidance: float | None = None
    size: str | None = None
    scheduler: str | None = None
    batch_size: float | None = None
    init_image: str | None = None              # a file path (image to image)
    strength: float | None = None
    preview_every: float | None = None
    precision: str | None = None
    channels_last: bool | None = None
    attention: str | None = None
    compile_mode: str | None = None
    fp8: bool | None = None
    prune_amount: float | None = None
    prune_method: str | None = None
    tensorrt: bool | None = None
    memory_savers: list[str] | None = None
    fuse_qkv: bool | None = None               # diffusion: fused Q/K/V projections
    request_graph: bool | None = None          # diffusion on a GPU: one CUDA graph per request
    tiny_vae: bool | None = None               # diffusion: TAESD decode and previews
    preview_method: str | None = None          # diffusion: what draws live previews (core.types.PREVIEW_METHODS)
    truncation_centre: str | None = None       # StyleGAN: class | global (what ψ pulls towards; after the toggles,
                                               # so positional API calls written before it keep their places)

    def given(self) -> dict[str, Any]:
        """The controls that carry a value, by name (what `job_spec` reads; the rest take its defaults)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


# every control the Generate and Compare events read, in the order of their inputs (their API signature)
CONTROL_NAMES: tuple[str, ...] = tuple(f.name for f in fields(StudioForm))

# the text fields among CONTROL_NAMES: a restored None becomes "" there
TEXT_CONTROLS = frozenset({"seed", "truncation_cutoff", "class_index", "mix_rows", "mix_cols", "sg_mode", "prompt",
                           "negative_prompt"})


def form_from_values(values: Sequence[Any]) -> StudioForm:
    """The components' values, in `CONTROL_NAMES` order (as Gradio passes an event's inputs) -> the form.
    A wrong number of values is a wiring mistake, said with the names that are missing or extra."""
    values = list(values)
    if len(values) != len(CONTROL_NAMES):
        if len(values) < len(CONTROL_NAMES):
            what = "missing " + ", ".join(CONTROL_NAMES[len(values):])
        else:
            what = f"{len(values) - len(CONTROL_NAMES)} value(s) too many"
        raise TypeError(f"the studio form takes {len(CONTROL_NAMES)} control values in the order of "
                        f"CONTROL_NAMES, got {len(values)} ({what})")
    return StudioForm(*values)


def form_from_named(values: dict[str, Any]) -> StudioForm:
    """The form from control values by name (a test, a restored parameter set); an unknown name is an error."""
    unknown = sorted(set(values) - set(CONTROL_NAMES))
    if unknown:
        raise TypeError(f"not studio controls: {', '.join(unknown)} (the controls are CONTROL_NAMES)")
    return StudioForm(**values)


def check_components(components: dict[str, Any]) -> list[Any]:
    """The input components of Generate and Compare, in `CONTROL_NAMES` order; a control the layout lacks
    (or one it has that the form does not) is a wiring mistake, said by name."""
    missing = [n for n in CONTROL_NAMES if n not in components]
    extra = sorted(set(components) - set(CONTROL_NAMES))
    if missing or extra:
        raise TypeError(f"the layout's controls do not match StudioForm: missing {missing or 'none'}, "
                        f"not in the form {extra or 'none'}")
    return [components[n] for n in CONTROL_NAMES]


def request_values(form: StudioForm, seed_backend: str = "stylegan") -> dict[str, Any]:
    """The form's values as `job_spec` reads them. `seed_backend` is the backend whose seed the page's seed
    field holds (`SessionState.seed_backend`): the page opens on StyleGAN, so a diffusion request whose field
    was never given to diffusion (no backend switch, no restore; e.g. a `gradio_client` call that names
    diffusion but no seed, which sends the field's initial value) and still holds StyleGAN's default list
    means "no seed given": random. A "0-7" typed into the diffusion field is taken as typed."""
    v = form.given()
    if (v.get("backend") == "diffusion" and seed_backend != "diffusion"
            and str(v.get("seed", "")).strip() == DEFAULT_SEED_TEXT["stylegan"]):
        v["seed"] = DEFAULT_SEED_TEXT["diffusion"]
    return v


def spec_from_form(form: StudioForm, make_spec: Callable[..., JobSpec], device: str | None,
                   seed_backend: str = "stylegan") -> JobSpec:
    """The job a form asks for (`make_spec`: `job_spec` or `compare_spec`). Raises InputError for a bad value."""
    return make_spec(request_values(form, seed_backend), device)

