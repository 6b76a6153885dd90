"""Plain events in, events out: the mapping of a topic's events to a model's inputs and
of its outputs to a result event (``WORKER_MAPPING_FILE``)."""

from worker.events.decode import MappedEvent, decode_event
from worker.events.mapping import Mappings, TopicMapping, load_mappings

__all__ = ["MappedEvent", "Mappings", "TopicMapping", "decode_event", "load_mappings"]
