"""The run configuration: typed sections (:mod:`.schema`), the one table of rules for every key
(:mod:`.rules`) and the checks every tool runs before any work (:mod:`.checks`)."""

from cals_seg.config.schema import Config, config_to_dict, load_config, save_config

__all__ = ["Config", "config_to_dict", "load_config", "save_config"]
