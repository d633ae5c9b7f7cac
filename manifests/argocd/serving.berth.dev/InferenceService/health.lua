-- Argo CD health check for Berth's InferenceService (serving.berth.dev/v1alpha1).
-- Reads only what the operator publishes for kstatus: status.observedGeneration and the Ready,
-- Stalled and Reconciling conditions. Lua 5.1 (Argo CD's gopher-lua).
local hs = {}

local function condition(kind)
  if obj.status ~= nil and obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == kind then
        return c
      end
    end
  end
  return nil
end

local generation = obj.metadata.generation
if obj.status == nil or obj.status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Berth operator to pick up the InferenceService"
  return hs
end
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the Berth operator to apply generation " .. generation
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.message or stalled.reason
  return hs
end

local autoscaling = obj.spec ~= nil and obj.spec.autoscaling ~= nil and obj.spec.autoscaling.enabled
if obj.spec ~= nil and obj.spec.replicas == 0 and not autoscaling then
  hs.status = "Suspended"
  hs.message = "Scaled to zero ranks (spec.replicas is 0)"
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = ready.reason .. ": " .. (ready.message or "")
else
  hs.message = "Waiting for the Ready condition"
end
return hs
