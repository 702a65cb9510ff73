{{/* The full name of the release's objects: the release name, with the chart name added when it is not already in it. */}}
{{- define "savepoint.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "savepoint.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "savepoint.labels" -}}
{{ include "savepoint.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: savepoint
app.kubernetes.io/managed-by: {{ .Values.managedBy | default .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "savepoint.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "savepoint.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "savepoint.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The kopf peering name: empty when peering is off. */}}
{{- define "savepoint.peeringName" -}}
{{- if .Values.peering.enabled -}}
{{- .Values.peering.name | default .Release.Name -}}
{{- end -}}
{{- end -}}

{{- define "savepoint.webhookService" -}}
{{- printf "%s-webhook" (include "savepoint.fullname" .) -}}
{{- end -}}

{{- define "savepoint.webhookSecret" -}}
{{- if .Values.webhook.certManager.enabled -}}
{{- printf "%s-webhook-tls" (include "savepoint.fullname" .) -}}
{{- else -}}
{{- required "webhook.tls.secretName is required when webhook.enabled and not webhook.certManager.enabled" .Values.webhook.tls.secretName -}}
{{- end -}}
{{- end -}}

{{/* Refuse values that would make a broken install. */}}
{{- define "savepoint.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peering.enabled) -}}
{{- fail "replicaCount > 1 needs peering.enabled: without peering every replica would reconcile the same objects" -}}
{{- end -}}
{{- if and .Values.webhook.enabled (not .Values.webhook.certManager.enabled) (not .Values.webhook.tls.caBundle) -}}
{{- fail "webhook.tls.caBundle is required when webhook.enabled and not webhook.certManager.enabled" -}}
{{- end -}}
{{- end -}}
