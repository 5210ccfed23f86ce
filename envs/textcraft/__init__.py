"""TextCraft (Minecraft crafting in text) as a ScalingInter environment: ``TextCraftEnv`` in ``envs.textcraft.env``."""
