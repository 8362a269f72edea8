"""A general plugin that adds a model architecture the gateway does not ship.

`register` runs in every process the gateway starts (the front end, the engine core, each
worker), before the model is built, and once more in a new process: so it checks before it
registers. The architecture is registered as a "module:Class" string: the model module (and
torch with it) is imported only where the model is built, in the workers, never in the
front end.
"""

ARCHITECTURE = "GatewayOotForCausalLM"


def register() -> None:
    from gateway.models import ModelRegistry

    if not ModelRegistry.is_registered(ARCHITECTURE):
        ModelRegistry.register_model(ARCHITECTURE, "gateway_oot_model.model:OotForCausalLM")
