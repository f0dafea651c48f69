{{/*
Names and labels shared by every template. Component names are "<fullname>-<component>" with the
fullname cut to 40 characters: the longest suffix ("-broker-headless") then still fits a 63-character
DNS label, and the StatefulSet name stays short enough for its pods' controller-revision-hash label.
*/}}

{{- define "lmq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lmq.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "lmq.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lmq.operator.fullname" -}}
{{- printf "%s-operator" (include "lmq.fullname" .) }}
{{- end }}

{{- define "lmq.broker.fullname" -}}
{{- printf "%s-broker" (include "lmq.fullname" .) }}
{{- end }}

{{- define "lmq.broker.headlessName" -}}
{{- printf "%s-broker-headless" (include "lmq.fullname" .) }}
{{- end }}

{{/*
The broker flags of the external listener (broker.external): its port and the addresses routes give clients
outside. More than one broker needs an address for each (a template, or one listed per pod); a single broker
without one answers with the address the client dialled.
*/}}
{{- define "lmq.broker.externalArgs" -}}
{{- $external := .Values.broker.external }}
{{- if and (gt (int .Values.broker.replicas) 1) (not $external.advertisedAddressTemplate) (lt (len $external.advertisedAddresses) (int .Values.broker.replicas)) }}
{{- fail "broker.external needs advertisedAddressTemplate, or one advertisedAddresses entry per broker replica" }}
{{- end }}
- --external-port
- {{ $external.port | quote }}
{{- with $external.advertisedAddresses }}
- --external-addresses
- {{ join "," . | quote }}
{{- end }}
{{- with $external.advertisedAddressTemplate }}
- --external-address-template
- {{ . | quote }}
{{- end }}
{{- end }}

{{- define "lmq.reclaim.fullname" -}}
{{- printf "%s-reclaim" (include "lmq.fullname" .) }}
{{- end }}

{{/* The Secret with the admin key pair (keys accessKey, secretKey): the user's, else the one the chart makes. */}}
{{- define "lmq.admin.secretName" -}}
{{- default (printf "%s-admin" (include "lmq.fullname" .)) .Values.admin.existingSecret }}
{{- end }}

{{/*
The admin pair as env entries; call with (dict "root" $ "prefix" "LMQ_ADMIN"). The broker reads
LMQ_ADMIN_*, the operator LMQ_OPERATOR_*, the reclaim job LMQ_RECLAIM_*; all sign with the same pair.
*/}}
{{- define "lmq.admin.env" -}}
- name: {{ .prefix }}_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ default (include "lmq.admin.secretName" .root) .secret }}
      key: accessKey
- name: {{ .prefix }}_SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ default (include "lmq.admin.secretName" .root) .secret }}
      key: secretKey
{{- end }}

{{/* ServiceAccount names: the configured one, else the component's full name when the chart creates it. */}}
{{- define "lmq.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "lmq.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lmq.broker.serviceAccountName" -}}
{{- if .Values.broker.serviceAccount.create }}
{{- default (include "lmq.broker.fullname" .) .Values.broker.serviceAccount.name }}
{{- else }}
{{- required "broker.serviceAccount.name is required when broker.serviceAccount.create is false" .Values.broker.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lmq.reclaim.serviceAccountName" -}}
{{- if .Values.reclaim.serviceAccount.create }}
{{- default (include "lmq.reclaim.fullname" .) .Values.reclaim.serviceAccount.name }}
{{- else }}
{{- required "reclaim.serviceAccount.name is required when reclaim.serviceAccount.create is false" .Values.reclaim.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component; call with (dict "root" $ "component" "broker"). Selectors are
immutable on StatefulSets and Deployments, so nothing that changes between releases goes in here.
*/}}
{{- define "lmq.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lmq.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Labels of pod templates: the selector labels and part-of, but not the chart or app version, so a chart
release that does not change a component's spec does not restart its pods.
*/}}
{{/*
The NetworkPolicy peers that may call the brokers' admin service: this release's operator, reclaim and backup
jobs, helm test and brokers, and networkPolicy.adminFrom. One list for the admin port 8082 (one process per
pod) and for the processes' ports 8082+i (broker.processes > 1), so both admit the same pods.
*/}}
{{- define "lmq.broker.adminPeers" -}}
{{- range $component := list "operator" "reclaim" "backup" "test" "broker" }}
- podSelector:
    matchLabels:
      {{- include "lmq.selectorLabels" (dict "root" $ "component" $component) | nindent 6 }}
{{- end }}
{{- with .Values.networkPolicy.adminFrom }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "lmq.podLabels" -}}
{{ include "lmq.selectorLabels" . }}
app.kubernetes.io/part-of: lmq
{{- end }}

{{/* Labels of every object; call with (dict "root" $ "component" "<name>"). */}}
{{- define "lmq.labels" -}}
helm.sh/chart: {{ include "lmq.chart" .root }}
{{ include "lmq.podLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The image of a component; call with (dict "root" $ "component" "broker"). The repository is the component's own,
else "<image.repository>-<component>" (the Dockerfile's targets). A digest pins the image whatever the tag says:
"repo:tag@digest" when image.tag is set too (the tag is then only a readable hint), "repo@digest" with a digest
alone, else "repo:tag" where the tag defaults to the chart's appVersion.
*/}}
{{- define "lmq.image" -}}
{{- $root := .root }}
{{- $own := index $root.Values .component "image" }}
{{- $repository := default (printf "%s-%s" $root.Values.image.repository .component) $own.repository }}
{{- $tag := $root.Values.image.tag }}
{{- if and $own.digest $tag }}
{{- printf "%s:%s@%s" $repository $tag $own.digest }}
{{- else if $own.digest }}
{{- printf "%s@%s" $repository $own.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default $root.Chart.AppVersion $tag) }}
{{- end }}
{{- end }}

{{/* The broker pods' per-pod DNS suffix: "<headless>.<namespace>.svc.<clusterDomain>". */}}
{{/*
spec.replicas of the broker StatefulSet. With the operator it is the operator's (it follows the lmq.io/replicas
annotation, draining pods before it stops them): an upgrade keeps the live value, which `lookup` reads (tools
that render without a cluster get broker.replicas: see docs/operator.md for Argo CD).
*/}}
{{- define "lmq.broker.replicas" -}}
{{- $live := lookup "apps/v1" "StatefulSet" .Release.Namespace (include "lmq.broker.fullname" .) }}
{{- if and .Values.operator.enabled $live $live.spec }}
{{- $live.spec.replicas | default .Values.broker.replicas }}
{{- else }}
{{- .Values.broker.replicas }}
{{- end }}
{{- end }}

{{/* The operator's ConfigMap of the broker membership: starting pods take their --peers from it (envFrom). */}}
{{- define "lmq.broker.membershipName" -}}
{{- printf "%s-broker-membership" (include "lmq.fullname" .) }}
{{- end }}

{{- define "lmq.broker.podDomain" -}}
{{- printf "%s.%s.svc.%s" (include "lmq.broker.headlessName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/*
TLS. The brokers mount the TLS Secret (tls.crt, tls.key); every caller mounts only the CA (caKey of caSecret,
as ca.crt) and checks the brokers' certificate against serverName, since it dials pod addresses.
*/}}
{{- define "lmq.tls.secretName" -}}
{{- if .Values.tls.existingSecret }}
{{- .Values.tls.existingSecret }}
{{- else if .Values.tls.certManager.enabled }}
{{- printf "%s-tls" (include "lmq.broker.fullname" .) }}
{{- else }}
{{- fail "tls.enabled needs tls.existingSecret (a Secret with tls.crt and tls.key) or tls.certManager.enabled" }}
{{- end }}
{{- end }}

{{- define "lmq.tls.serverName" -}}
{{- default (printf "%s.%s.svc" (include "lmq.broker.fullname" .) .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/* Environment of a TLS caller (lmq.admin.tls: LMQ_TLS_CA, LMQ_TLS_SERVER_NAME); empty without TLS. */}}
{{- define "lmq.tls.clientEnv" -}}
{{- if .Values.tls.enabled -}}
- name: LMQ_TLS_CA
  value: /etc/lmq/ca/ca.crt
- name: LMQ_TLS_SERVER_NAME
  value: {{ include "lmq.tls.serverName" . }}
{{- end }}
{{- end }}

{{- define "lmq.tls.caMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls-ca
  mountPath: /etc/lmq/ca
  readOnly: true
{{- end }}
{{- end }}

{{- define "lmq.tls.caVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls-ca
  secret:
    secretName: {{ default (include "lmq.tls.secretName" .) .Values.tls.caSecret }}
    items:
      - key: {{ .Values.tls.caKey }}
        path: ca.crt
    defaultMode: 0444
{{- end }}
{{- end }}

{{/*
The image runs `python -m <module>` (Dockerfile ENTRYPOINT ["python", "-m"]); the chart spells the full
command so `kubectl describe` shows exactly what runs. Call with the module name.
*/}}
{{- define "lmq.command" -}}
- python
- -m
- {{ . }}
{{- end }}

{{/* Pod-level securityContext shared by all components: non-root, RuntimeDefault seccomp. */}}
{{- define "lmq.podSecurityContext" -}}
runAsNonRoot: true
{{- with .Values.podSecurity.runAsUser }}
runAsUser: {{ . }}
{{- end }}
{{- with .Values.podSecurity.runAsGroup }}
runAsGroup: {{ . }}
{{- end }}
{{- with .Values.podSecurity.fsGroup }}
fsGroup: {{ . }}
fsGroupChangePolicy: OnRootMismatch
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Container-level securityContext: nothing in the image needs to write outside its volumes (Python runs
with PYTHONDONTWRITEBYTECODE and every writer gets an emptyDir or the data volume), so the root
filesystem is read-only and every capability is dropped.
*/}}
{{- define "lmq.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop:
    - ALL
{{- end }}

{{/*
What the operator does with its own resources, in the namespaces it watches (docs/operator.md lists the same
rules, and its test suite runs the operator with nothing more): follow them, patch in the finalizer and
kopf's progress annotations, patch status, and post events about them. It never creates, updates or deletes
them: the operator is one-way.
*/}}
{{- define "lmq.operator.resourceRules" -}}
- apiGroups: ["lmq.io"]
  resources: ["parenttopics", "litegroups", "litequotas", "lmqusers"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["lmq.io"]
  resources: ["parenttopics/status", "litegroups/status", "litequotas/status", "lmqusers/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# An LmqUser's secret: get of the one Secret it names, at each reconcile; never list or watch (no Secret is read
# that no LmqUser names, and none is kept in memory).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}

{{/* Copies of every ring slot (broker.replication.replicas; null: 2 with two or more pods, else 1). */}}
{{- define "lmq.broker.replicationFactor" -}}
{{- $r := .Values.broker.replication.replicas }}
{{- if kindIs "invalid" $r }}
{{- ge (int .Values.broker.replicas) 2 | ternary 2 1 }}
{{- else }}
{{- $r | int }}
{{- end }}
{{- end }}
