"""ScienceWorld as a ScalingInter environment: ``SciWorldEnv`` in ``envs.sciworld.env`` (JVM pool in ``jvm``)."""
