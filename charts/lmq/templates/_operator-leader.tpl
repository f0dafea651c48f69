{{/*
The operator's leader-election environment: the Lease "<fullname>-operator" in the release namespace, this
pod's name as its identity (also the reportingInstance of its Events), and the timings.
*/}}
{{- define "lmq.operator.leaderEnv" -}}
- name: LMQ_OPERATOR_LEASE_NAME
  value: {{ include "lmq.operator.fullname" . }}
- name: LMQ_OPERATOR_LEASE_NAMESPACE
  value: {{ .Release.Namespace }}
- name: LMQ_OPERATOR_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: LMQ_OPERATOR_LEASE_DURATION_SECONDS
  value: {{ .Values.operator.leaderElection.leaseDurationSeconds | quote }}
- name: LMQ_OPERATOR_LEASE_RENEW_DEADLINE_SECONDS
  value: {{ .Values.operator.leaderElection.renewDeadlineSeconds | quote }}
- name: LMQ_OPERATOR_LEASE_RETRY_SECONDS
  value: {{ .Values.operator.leaderElection.retryPeriodSeconds | quote }}
{{- end }}
