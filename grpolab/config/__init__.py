"""The config: one dataclass (``schema``), read from YAML and flags (``load``), checked
(``validate``), with TRL's names accepted (``trl``)."""

from grpolab.config.load import load_yaml, make_config, to_dict
from grpolab.config.schema import Config, ConfigError, literal_fields
from grpolab.config.speed import Speed
from grpolab.config.validate import resolve, validate
from grpolab.config.values import coerce

__all__ = ["Config", "ConfigError", "Speed", "coerce", "literal_fields", "load_yaml",
           "make_config", "resolve", "to_dict", "validate"]
