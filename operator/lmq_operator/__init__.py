"""kopf operator reconciling ParentTopic, LiteGroup and LiteQuota into every broker pod."""
