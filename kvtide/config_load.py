"""One config loader for every section of `EngineConfig`: defaults < file (YAML/JSON) < KVTIDE_* env < explicit.

Fields come from the dataclasses in `kvtide.config`, so a field added there is settable everywhere at once: a
top-level field as ``KVTIDE_<FIELD>`` / file key ``<field>``, a section field as ``KVTIDE_<SECTION>_<FIELD>`` /
``<section>: {<field>: ...}`` (sections: cache, scheduler, restore). Strings are parsed by the field's annotation
(`config_values`); a bad value names its variable or file key and the expected type. ``restore`` stays None unless
a layer configures it (any ``KVTIDE_RESTORE_*``, ``KVTIDE_RESTORE=1``, a ``restore:`` key not ``false``, an
override). Explicit values are Python values and reach the dataclasses as given; a section passed as a dataclass
instance is taken whole. Unknown file keys are errors; unknown ``KVTIDE_*`` names log a warning. Fields named like
a secret or password keep their string as given, and no message or printed config shows them (nor URL passwords).
The file's ``server:`` section belongs to ``kvtide serve``: `load_settings` returns it beside the engine config.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import CacheConfig, EngineConfig, RestoreConfig, SchedulerConfig, redact_url
from .config_values import parse_value
from .log import get_logger, warn_limited

log = get_logger("config")

ENV_PREFIX = "KVTIDE_"
SECTIONS: dict[str, type] = {"cache": CacheConfig, "scheduler": SchedulerConfig, "restore": RestoreConfig}
OPTIONAL_SECTIONS = frozenset({"restore"})  # None unless a layer configures them
SERVER = "server"  # the file section (and KVTIDE_SERVER_* names) reserved for `kvtide serve`
# KVTIDE_* variables that are not config fields but are read elsewhere: never warned about
OTHER_ENV_VARS = frozenset({
    "KVTIDE_CACHE_DIR",  # models/registry.py: where converted models live
    "KVTIDE_STORE_SECRET",  # store/auth.py: the records' keyed digest when RestoreConfig.secret is unset
    "KVTIDE_PDL_NUDGE",  # engine/cuda_graphs.py
    "KVTIDE_NVRTC",  # kernels/cuda_jit.py: the NVRTC library
})
# fields that set one quantity two ways: the highest layer that sets one of them owns the group (a --num-pages flag
# replaces a file's kv_cache_bytes instead of clashing with it)
EXCLUSIVE: dict[str, tuple[tuple[str, ...], ...]] = {"cache": (("num_pages", "kv_cache_bytes"),)}
MAX_FILE_BYTES = 1 << 20
_SECRET_NAME = re.compile(r"secret|password", re.I)


@dataclass(frozen=True)
class Settings:
    """What a config resolves to: the engine's config and the ``server`` section (an instance of the server type
    given to `load_settings`, else the file's ``server:`` mapping updated by ``overrides["server"]``, unparsed)."""

    engine: EngineConfig
    server: Any


class _Off:
    """A layer that turns an optional section off (restore: false / None)."""


_OFF = _Off()


@dataclass
class _Layer:
    sections: dict[str | None, Any]  # None: top-level fields -> dict; section -> dict, instance or _OFF
    origins: dict[str, str]  # "cache.page_size" -> "KVTIDE_CACHE_PAGE_SIZE='12'"


def load_config(overrides: Mapping[str, Any] | EngineConfig | None = None, *, file: str | os.PathLike | None = None,
                env: Mapping[str, str] | None = None) -> EngineConfig:
    """The engine config from defaults < ``file`` < ``env`` (default ``os.environ``) < ``overrides``.

    ``overrides``: explicit values nested by section (``{"model": ..., "cache": {"num_pages": 64}}``), a section as
    a dataclass instance (``cache=CacheConfig(...)``, taken whole), ``restore=None`` to keep restoration off, or an
    `EngineConfig`. A ``server`` entry (of the overrides or the file) is accepted and left to `load_settings`."""
    return load_settings(overrides, file=file, env=env).engine


def load_settings(overrides: Mapping[str, Any] | EngineConfig | None = None, *,
                  file: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                  server_type: type | None = None, origins: Mapping[str, str] | None = None,
                  defaults: Mapping[str, Any] | None = None) -> Settings:
    """`load_config` plus the ``server`` section. With ``server_type`` (a dataclass) the server section is resolved
    like the others (``KVTIDE_SERVER_<FIELD>``, file ``server:``, ``overrides["server"]``); without, the file's
    mapping is returned as read and ``KVTIDE_SERVER_*`` names are left alone. ``origins`` names where explicit
    values came from in error messages (``{"cache.num_pages": "--num-pages"}``; default ``argument <key>``).
    ``defaults``: values nested like ``overrides`` that replace the dataclass defaults (below the file), for a
    command whose defaults differ (``kvtide serve`` on CUDA)."""
    sections: dict[str, type] = dict(SECTIONS)
    if server_type is not None:
        if not dataclasses.is_dataclass(server_type):
            raise TypeError(f"server_type must be a dataclass, got {server_type!r}")
        sections[SERVER] = server_type
    catalog = _catalog(sections)
    layers: list[_Layer] = []
    if defaults:
        layers.append(_explicit_layer(defaults, catalog, sections, {}))
    server_raw: Any = {}
    if file is not None:
        data = read_config_file(file)
        if server_type is None:
            server_raw = dict(_section_mapping(data.pop(SERVER, None), f"{os.fspath(file)}: {SERVER}") or {})
        layers.append(_file_layer(data, catalog, os.fspath(file)))
    layers.append(_env_layer(os.environ if env is None else env, catalog, reserve_server=server_type is None))
    explicit = _explicit_layer(overrides, catalog, sections, origins or {})
    given = overrides.get(SERVER) if server_type is None and isinstance(overrides, Mapping) else None
    if isinstance(given, Mapping):
        server_raw.update(given)
    elif given is not None:  # e.g. the serve command's own dataclass, taken whole
        server_raw = given
    layers.append(explicit)
    engine = _build(catalog, layers)
    server = _resolve(SERVER, sections[SERVER], layers, catalog)[0] if server_type is not None else server_raw
    return Settings(engine=engine, server=server)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping in a YAML (or ``.json``) config file; ValueError for a file too large, unparsable or not a
    mapping."""
    import yaml

    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"config file {p}: {size} bytes, expected at most {MAX_FILE_BYTES}")
        with p.open("rb") as f:
            text = f.read(MAX_FILE_BYTES + 1).decode("utf-8")
    except OSError as e:
        raise ValueError(f"config file {p}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if len(text) > MAX_FILE_BYTES:
        raise ValueError(f"config file {p}: more than {MAX_FILE_BYTES} bytes")
    kind = "JSON" if p.suffix.lower() == ".json" else "YAML"
    try:
        data = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as e:
        raise ValueError(f"config file {p}: not valid {kind}: {e}") from None
    except RecursionError:
        raise ValueError(f"config file {p}: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def config_dict(cfg: EngineConfig, *, redact: bool = True) -> dict[str, Any]:
    """``cfg`` in the file's layout (what `read_config_file` accepts back); ``restore: false`` when off. With
    ``redact``, fields named like a secret or password and passwords inside URLs are masked (for printing)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in SECTIONS:
            out[f.name] = False if value is None else {g.name: _shown(g.name, getattr(value, g.name), redact)
                                                       for g in dataclasses.fields(value)}
        else:
            out[f.name] = _shown(f.name, value, redact)
    return out


def _shown(name: str, value: Any, redact: bool) -> Any:
    if not redact or value is None:
        return value
    if _SECRET_NAME.search(name):
        return "<redacted>"
    return redact_url(value) if isinstance(value, str) else value


# --- the catalog of fields ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Field:
    section: str | None
    name: str
    type: Any

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.replace(".", "_").upper()


def _catalog(sections: Mapping[str, type]) -> dict[str | None, dict[str, _Field]]:
    """Section (None: EngineConfig's own fields) -> field name -> field, types resolved from the annotations."""
    out: dict[str | None, dict[str, _Field]] = {}
    for section, cls in [(None, EngineConfig), *sections.items()]:
        hints = typing.get_type_hints(cls)
        out[section] = {f.name: _Field(section, f.name, hints[f.name]) for f in dataclasses.fields(cls)
                        if f.init and not (section is None and f.name in SECTIONS)}
    return out


def _parse(f: _Field, raw: Any, where: str) -> Any:
    """`parse_value`, except that a secret's string is taken as it is (a secret 'none' is not None; '' is unset)."""
    if _SECRET_NAME.search(f.name) and isinstance(raw, str) and raw and str in (f.type, *typing.get_args(f.type)):
        return parse_value(raw, str, where)
    return parse_value(raw, f.type, where)


def _closest(name: str, candidates: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _section_mapping(value: Any, where: str) -> Mapping[str, Any] | None:
    if value is None or isinstance(value, Mapping):
        return value
    raise ValueError(f"{where}: expected a mapping of fields, got {type(value).__name__} {value!r:.80}")


# --- layers -----------------------------------------------------------------------------------------------------

def _file_layer(data: Mapping[str, Any], catalog: Mapping[str | None, Mapping[str, _Field]], path: str) -> _Layer:
    layer = _Layer({None: {}}, {})
    top = catalog[None]
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{path}: key {key!r} is not a string")
        if key in top:
            layer.sections[None][key] = _parse(top[key], value, f"{path}: {key}")
            layer.origins[key] = f"{path}: {key}"
            continue
        if key not in catalog:
            valid = [*top, *(s for s in catalog if s is not None), SERVER]
            raise ValueError(f"{path}: unknown key '{key}'{_closest(key, valid)}")
        if key in OPTIONAL_SECTIONS and isinstance(value, bool):
            layer.sections[key] = {} if value else _OFF
            continue
        fields = catalog[key]
        values: dict[str, Any] = {}
        for name, raw in (_section_mapping(value, f"{path}: {key}") or {}).items():
            if not isinstance(name, str) or name not in fields:
                raise ValueError(f"{path}: unknown key '{key}.{name}'"
                                 f"{_closest(f'{key}.{name}', [g.key for g in fields.values()])}")
            values[name] = _parse(fields[name], raw, f"{path}: {key}.{name}")
            layer.origins[f"{key}.{name}"] = f"{path}: {key}.{name}"
        layer.sections[key] = values
    return layer


def _env_layer(env: Mapping[str, str], catalog: Mapping[str | None, Mapping[str, _Field]], *,
               reserve_server: bool) -> _Layer:
    by_env = {f.env: f for fields in catalog.values() for f in fields.values()}
    layer = _Layer({None: {}}, {})
    switches = {ENV_PREFIX + s.upper(): s for s in OPTIONAL_SECTIONS}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in switches:
            continue
        raw = env[name]
        if name in by_env:
            f = by_env[name]
            layer.sections.setdefault(f.section, {})[f.name] = _parse(f, raw, name)
            shown = _shown(f.name, raw, True)  # an error message never echoes a secret or a URL's password
            layer.origins[f.key] = f"{name}={shown}" if shown == "<redacted>" else f"{name}={shown!r}"
        elif name in OTHER_ENV_VARS or (reserve_server and name.startswith(f"{ENV_PREFIX}{SERVER.upper()}_")):
            continue
        else:
            warn_limited(log, f"config-env:{name}", "unknown environment variable %s ignored%s", name,
                         _closest(name, [*by_env, *switches, *OTHER_ENV_VARS]), interval=3600.0)
    for name, section in switches.items():  # KVTIDE_RESTORE=1: on with what the other variables set, 0: off
        if name not in env:
            continue
        if not parse_value(env[name], bool, name):
            set_too = sorted(f.env for f in catalog[section].values() if f.env in env)
            if set_too:
                raise ValueError(f"{name}={env[name]!r} turns {section} off, but {', '.join(set_too)} "
                                 f"{'is' if len(set_too) == 1 else 'are'} set too")
            layer.sections[section] = _OFF
        else:
            layer.sections.setdefault(section, {})
    return layer


def _explicit_layer(overrides: Mapping[str, Any] | EngineConfig | None,
                    catalog: Mapping[str | None, Mapping[str, _Field]], classes: Mapping[str, type],
                    origins: Mapping[str, str]) -> _Layer:
    if isinstance(overrides, EngineConfig):
        overrides = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)}
    layer = _Layer({None: {}}, {})
    top = catalog[None]
    for key, value in (overrides or {}).items():
        if key in top:
            layer.sections[None][key] = value
            layer.origins[key] = origins.get(key, f"argument {key}")
            continue
        if key == SERVER and SERVER not in catalog:
            continue  # returned unparsed by load_settings
        if key not in catalog:
            raise TypeError(f"unknown config option '{key}'{_closest(key, [*top, *catalog.keys() - {None}])}")
        fields = catalog[key]
        if value is None or value is False:
            if key not in OPTIONAL_SECTIONS:
                raise TypeError(f"config section '{key}' cannot be {value!r}: give a mapping or a "
                                f"{classes[key].__name__}")
            layer.sections[key] = _OFF
        elif value is True and key in OPTIONAL_SECTIONS:
            layer.sections[key] = {}
        elif isinstance(value, classes[key]):
            layer.sections[key] = value
            layer.origins.update({f"{key}.{n}": origins.get(key, f"argument {key}") for n in fields})
        elif isinstance(value, Mapping):
            for name in value:
                if name not in fields:
                    raise TypeError(f"unknown config option '{key}.{name}'"
                                    f"{_closest(f'{key}.{name}', [g.key for g in fields.values()])}")
                layer.origins[f"{key}.{name}"] = origins.get(f"{key}.{name}", f"argument {key}.{name}")
            layer.sections[key] = dict(value)
        else:
            raise TypeError(f"config section '{key}' must be a mapping or a {classes[key].__name__}, "
                            f"got {type(value).__name__}")
    return layer


# --- resolution -------------------------------------------------------------------------------------------------

def _merge(section: str | None, layers: list[_Layer], fields: Mapping[str, _Field]
           ) -> tuple[Any, dict[str, str]]:
    """The section's field values over the layers (low to high): a dict, an instance (taken whole), or _OFF."""
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    state: Any = _OFF if section in OPTIONAL_SECTIONS else merged
    for layer in layers:
        value = layer.sections.get(section)
        prefix = f"{section}." if section else ""
        if value is None:
            continue
        if value is _OFF:
            merged, origins, state = {}, {}, _OFF
            continue
        if not isinstance(value, dict):  # a dataclass instance: every field set
            merged = {n: getattr(value, n) for n in fields}
            origins = {k: v for k, v in layer.origins.items() if k.startswith(prefix)}
            state = value
            continue
        for group in EXCLUSIVE.get(section or "", ()):
            if any(n in value for n in group):
                for n in group:
                    merged.pop(n, None)
                    origins.pop(prefix + n, None)
        merged.update(value)
        origins.update({prefix + n: layer.origins.get(prefix + n, "") for n in value})
        state = merged
    return state, origins


def _resolve(section: str, cls: type, layers: list[_Layer], catalog: Mapping[str | None, Mapping[str, _Field]]
             ) -> tuple[Any, dict[str, str]]:
    """The section's object (None when an optional section is off) and where its set fields came from."""
    state, origins = _merge(section, layers, catalog[section])
    if state is _OFF:
        return None, {}
    if not isinstance(state, dict):
        return state, origins
    return _construct(cls, state, origins), origins


def _build(catalog: Mapping[str | None, Mapping[str, _Field]], layers: list[_Layer]) -> EngineConfig:
    top, origins = _merge(None, layers, catalog[None])
    built = {}
    for s, cls in SECTIONS.items():
        built[s], section_origins = _resolve(s, cls, layers, catalog)
        origins.update(section_origins)
    return _construct(EngineConfig, {**top, **built}, origins)


def _construct(cls: type, values: Mapping[str, Any], origins: Mapping[str, str]) -> Any:
    """``cls(**values)``; a validation error says which of the set values it is about and where each came from."""
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        msg = str(e)
        named = list(dict.fromkeys(where for key, where in origins.items()
                                   if where and re.search(rf"\b{re.escape(key.rsplit('.', 1)[-1])}\b", msg)))
        raise type(e)(f"{msg} (set by {'; '.join(named)})" if named else msg) from None
