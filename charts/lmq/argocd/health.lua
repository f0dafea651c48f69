-- Argo CD health of lmq.io ParentTopic, LiteGroup, LiteQuota and LmqUser resources (see docs/gitops.md).
-- Reads what the lmq operator writes: status.observedGeneration, and the conditions Ready, Reconciling
-- (not ready, still being retried) and Stalled (not ready until someone changes something).
local hs = {status = "Progressing", message = "Waiting for the lmq operator"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local conditions = {}
for _, condition in ipairs(obj.status.conditions) do
  conditions[condition.type] = condition
end
local ready = conditions["Ready"]
if ready == nil then
  return hs
end
local function describe(condition)
  return (condition.reason or "") .. ": " .. (condition.message or "")
end
if ready.reason == "ReconciliationPaused" then
  hs.status = "Suspended"
  hs.message = describe(ready)
  return hs
end
local generation = obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.message = "Waiting for the lmq operator to apply generation " .. tostring(generation)
  return hs
end
local stalled = conditions["Stalled"]
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end
if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or ""
  return hs
end
local reconciling = conditions["Reconciling"]
if ready.status == "False" and (reconciling == nil or reconciling.status ~= "True") then
  hs.status = "Degraded"
end
hs.message = describe(ready)
return hs
