"""The registered merge methods, by name: the built-in ones (:mod:`lmdx.merge.builtin`),
those registered with :func:`register_method`, and those installed as packages that
declare an entry point in the group ``lmdx.merge_methods`` (:data:`ENTRY_POINTS`).

A method followed by a post-step (:data:`lmdx.merge.builtin.POST_STEPS`: SVC) is named
``<method>+<post-step>`` (``ties+svc``): :func:`method_named` makes it on first use, with
the method's options and the post-step's.

The front doors, the configuration files, ``lmdx merge`` and the model card find a method
here by its name; below this module a merge handles the method object itself
(:class:`lmdx.merge.method.MergeMethod`). A method's own options are checked here too,
since a key is refused with the names of the methods that take it.

An installed method is one entry point named as the method, whose object is a
:class:`MergeMethod` subclass (or instance), e.g. in the package's ``pyproject.toml``::

    [project.entry-points."lmdx.merge_methods"]
    power_mean = "lmdx_power_mean:PowerMean"

The installed methods are loaded the first time a method is looked up by name or the
methods are listed, in any process (a script, ``lmdx merge``, a Ray worker). One that
cannot be loaded (its package fails to import, it is no method, its name is taken) takes
nothing from the others: asking for it by name raises the reason
(:func:`method_named`), ``lmdx methods`` shows it (:func:`unloaded_methods`).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from .._errors import MergeError
from .._util import did_you_mean
from .builtin import BUILT_IN, POST_STEPS
from .method import COPY, MergeMethod, NoOptions, PostStep
from .options import MergeOptions, OptionError, option_error, plain

__all__ = [
    "ENTRY_POINTS",
    "all_options",
    "merge_options",
    "method_named",
    "method_names",
    "method_options",
    "methods",
    "option_users",
    "post_steps",
    "register_method",
    "unloaded_methods",
    "unused_option",
]

#: The entry-point group of merge methods installed as packages.
ENTRY_POINTS = "lmdx.merge_methods"

_METHODS: dict[str, MergeMethod] = {}
_UNLOADED: dict[str, str] = {}  # installed methods that could not be loaded: name -> why
_installed_loaded = False
_FOLLOWED: dict[tuple[str, str, int], MergeMethod] = {}  # (method, post-step, id) -> both


def _checked(method: MergeMethod, where: str) -> MergeMethod:
    """``method`` if it can be registered; :class:`MergeError` (``where``: who asked)."""
    if not isinstance(method, MergeMethod):
        raise MergeError(f"{where}: expected a MergeMethod, got {type(method).__name__}")
    if not method.name.isidentifier():
        raise MergeError(f"{where}: name {method.name!r} is not an identifier")
    if method.name == COPY.name:
        raise MergeError(
            f"{where}: name {method.name!r} is taken by the copies of tensors that are not "
            "floating point; choose another"
        )
    if not issubclass(method.options, NoOptions):
        raise MergeError(f"{where}: {method.name}: options must derive from lmdx.merge.NoOptions")
    if method.stats not in (None, "regmean-gram", "fisher"):
        raise MergeError(f"{where}: {method.name}: unknown statistics {method.stats!r}")
    return method


def register_method(method: MergeMethod) -> MergeMethod:
    """Make ``method`` available by its name to every front door, the configuration files
    and ``lmdx merge``; returns it. Registering a name again replaces that method."""
    _METHODS[_checked(method, "register_method").name] = method
    return method


for _builtin in BUILT_IN:
    register_method(_builtin)


def _load_installed() -> None:
    """Register the methods installed packages declare (:data:`ENTRY_POINTS`), once per
    process (one whose module registered it on import is kept as registered); what
    cannot be registered is kept, with why, in :func:`unloaded_methods`."""
    global _installed_loaded
    if _installed_loaded:
        return
    _installed_loaded = True
    for point in entry_points(group=ENTRY_POINTS):
        dist = getattr(point.dist, "name", None) or "a package"
        where = f"merge method {point.name!r} installed by {dist} ({point.value})"
        try:
            found: Any = point.load()
            if isinstance(found, type) and issubclass(found, MergeMethod):
                found = found()
            method = found
            _checked(method, where)
            if method.name != point.name:
                raise MergeError(f"{where}: the entry point names {method.name!r}, not itself")
            known = _METHODS.get(method.name)
            if known is not None and type(known) is not type(method):
                raise MergeError(
                    f"{where}: the name {method.name!r} is taken by {type(known).__name__}"
                )
        except MergeError as exc:
            _UNLOADED[point.name] = f"{exc}; fix or uninstall that package"
        except Exception as exc:  # any failure of another package's code on import
            _UNLOADED[point.name] = (
                f"{where} could not be loaded ({type(exc).__name__}: {exc}); fix or uninstall "
                "that package"
            )
        else:
            _METHODS.setdefault(method.name, method)


def unloaded_methods() -> dict[str, str]:
    """The installed methods that could not be loaded: name -> why (one line each)."""
    _load_installed()
    return dict(_UNLOADED)


def methods() -> Mapping[str, MergeMethod]:
    """Every registered method by name: the built-in ones first, then those registered in
    this process and those installed (in the order they came)."""
    _load_installed()
    return dict(_METHODS)


def method_names() -> tuple[str, ...]:
    """The names of the registered methods."""
    return tuple(methods())


def post_steps() -> dict[str, PostStep]:
    """The post-steps a method can be followed by (``<method>+<post-step>``), by name."""
    return {p.name: p for p in POST_STEPS}


def method_named(name: str) -> MergeMethod:
    """The method registered as ``name``, or a registered method followed by a post-step
    (``ties+svc``); :class:`MergeError` lists the known ones (or says why an installed one
    named so could not be loaded)."""
    found = methods().get(name)
    if found is not None:
        return found
    inner, plus, post = name.partition("+")
    if plus and post in post_steps() and inner in methods():
        method = methods()[inner]
        key = (inner, post, id(method))
        if key not in _FOLLOWED:
            _FOLLOWED[key] = post_steps()[post].wrap(method)
        return _FOLLOWED[key]
    if name in _UNLOADED:
        raise MergeError(_UNLOADED[name])
    if plus and inner in methods():
        raise MergeError(
            f"method: {name!r}: no post-step {post!r}; the post-steps are "
            f"{tuple(post_steps())} (e.g. {inner}+{next(iter(post_steps()))})"
        )
    raise MergeError(
        f"method: expected one of {method_names()} (each may be followed by a post-step: "
        f"+{', +'.join(post_steps())}), got {name!r}{did_you_mean(name, method_names())}"
    )


# --------------------------------------------------------------------------- options


def option_users(key: str) -> list[str]:
    """The registered methods that take option ``key``, and the post-steps
    (``METHOD+svc``)."""
    users = [m.name for m in methods().values() if key in m.options.model_fields]
    return users + [f"METHOD+{p.name}" for p in POST_STEPS if key in p.options.model_fields]


def _options_of(user: str) -> type[BaseModel]:
    """The options model of an :func:`option_users` entry."""
    if user.startswith("METHOD+"):
        return post_steps()[user.removeprefix("METHOD+")].options
    return method_named(user).options


def all_options() -> dict[str, Any]:
    """Every method option of the registered methods and the post-steps: name -> its
    pydantic field (the first method's that declares it)."""
    out: dict[str, Any] = {}
    for model in (*(m.options for m in methods().values()), *(p.options for p in POST_STEPS)):
        for key, f in model.model_fields.items():
            out.setdefault(key, f)
    return out


def unused_option(key: str, method: str) -> OptionError:
    """Option ``key`` given to a method that does not take it (a post-step's option: to
    that method followed by the post-step)."""
    users = [u.replace("METHOD", method.partition("+")[0], 1) for u in option_users(key)]
    who = f"method {users[0]}" if len(users) == 1 else ", ".join(users)
    return OptionError(key, f"used by {who}, not {method}", None, unused=True)


def _ignored_elsewhere(key: str) -> bool:
    """Whether option ``key`` is accepted, and ignored, by methods that do not take it
    (``json_schema_extra={"elsewhere": "ignored"}``, as the RegMean solve's options)."""
    for m in methods().values():
        f = m.options.model_fields.get(key)
        extra = None if f is None else f.json_schema_extra
        if isinstance(extra, dict) and extra.get("elsewhere") == "ignored":
            return True
    return False


def _check_one(model: type[BaseModel], key: str, value: Any) -> None:
    """Option ``key`` of ``model`` checked alone (its error names it); checks across
    fields (DELLA's density ± epsilon) wait for the options together."""
    try:
        model.model_validate({key: value})
    except ValidationError as exc:
        if any(err["loc"] for err in exc.errors(include_url=False)):
            raise option_error(key, model, exc) from None


def method_options(method: str, given: Mapping[str, Any]) -> BaseModel:
    """``method``'s options from the ``given`` keys (None: the default), checked by its
    pydantic model; keys other methods take are refused (or, for the solver's, ignored)."""
    model = method_named(method).options
    own: dict[str, Any] = {}
    for key, value in given.items():
        if value is None:
            continue
        value = plain(value)
        if key in model.model_fields:
            own[key] = value
        elif not option_users(key):
            known = sorted({*all_options(), *MergeOptions.keyword_paths()})
            raise MergeError(f"unknown option {key!r}; the options are {known}")
        else:  # a valid value of another method's option: refused, or ignored here
            _check_one(_options_of(option_users(key)[0]), key, value)
            if not _ignored_elsewhere(key):
                raise unused_option(key, method)
    for key, value in own.items():
        _check_one(model, key, value)
    try:
        return model.model_validate(own)
    except ValidationError as exc:  # a check across fields (its message names them)
        msg = str(exc.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")
        raise MergeError(f"method {method}: {msg}") from None


def merge_options(
    k: int, method: str, given: Mapping[str, Any], *, writes: bool = True
) -> MergeOptions:
    """The checked options of a merge of ``k`` models by the method registered as
    ``method``, from a front door's keyword arguments ``given``: the shared ones
    (:meth:`MergeOptions.keyword_paths`; those of writing a folder only if the door writes
    one, ``writes``) and the method's own."""
    paths = MergeOptions.keyword_paths()
    shared = {key: value for key, value in given.items() if key in paths}
    own = method_options(method, {key: v for key, v in given.items() if key not in paths})
    fixed = {"method": method, "method_options": own}
    checked: MergeOptions = MergeOptions.from_keywords(shared, fixed, writes=writes)
    return MergeOptions.for_models(k, checked)
