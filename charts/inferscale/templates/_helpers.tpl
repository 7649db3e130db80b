{{/* Chart name; the serving pods' app.kubernetes.io/name label (the operator's server selector uses it). */}}
{{- define "inferscale.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name, at most 63 characters. */}}
{{- define "inferscale.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "inferscale.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "inferscale.labels" -}}
helm.sh/chart: {{ include "inferscale.chart" . }}
app.kubernetes.io/name: {{ include "inferscale.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ include "inferscale.imageTag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inferscale
{{- end }}

{{- define "inferscale.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inferscale.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Per-component labels: call with (dict "ctx" $ "component" "server"). */}}
{{- define "inferscale.componentLabels" -}}
{{ include "inferscale.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "inferscale.componentSelectorLabels" -}}
{{ include "inferscale.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Label selector string the operator uses to find this release's serving pods. */}}
{{- define "inferscale.serverSelector" -}}
{{- $parts := list }}
{{- range $k, $v := fromYaml (include "inferscale.componentSelectorLabels" (dict "ctx" . "component" "server")) }}
{{- $parts = append $parts (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," (sortAlpha $parts) }}
{{- end }}

{{- define "inferscale.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- define "inferscale.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "inferscale.imageTag" .) }}
{{- end }}

{{/* The operator's image: the slim `operator` target of the Dockerfile (no torch); empty repository = the serving image. */}}
{{- define "inferscale.operatorImage" -}}
{{- with .Values.operator.image }}
{{- if .repository }}
{{- printf "%s:%s" .repository (default (include "inferscale.imageTag" $) .tag) }}
{{- else }}
{{- include "inferscale.image" $ }}
{{- end }}
{{- end }}
{{- end }}

{{- define "inferscale.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "inferscale.componentName" (dict "ctx" . "suffix" "operator")) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "inferscale.internalTokenSecretName" -}}
{{- default (include "inferscale.componentName" (dict "ctx" . "suffix" "internal")) .Values.internalToken.existingSecret }}
{{- end }}

{{- define "inferscale.kekSecretName" -}}
{{- default (include "inferscale.componentName" (dict "ctx" . "suffix" "kek")) .Values.kek.existingSecret }}
{{- end }}

{{/* Where servers and encode Jobs see the KEK file (docs/interfaces.md). */}}
{{- define "inferscale.kekMount" -}}/var/run/inferscale/kek{{- end }}

{{- define "inferscale.apiKeysSecretName" -}}
{{- default (include "inferscale.componentName" (dict "ctx" . "suffix" "api-keys")) .Values.apiKeys.existingSecret }}
{{- end }}

{{/* Where the servers see the tenants file. */}}
{{- define "inferscale.tenantsFile" -}}
{{- printf "/etc/inferscale/tenants/%s" .Values.apiKeys.existingSecretKey }}
{{- end }}

{{/* Encoder placement: falls back to the servers' so blobs are written on serving nodes. */}}
{{- define "inferscale.encoderNodeSelector" -}}
{{- $sel := .Values.encoder.nodeSelector | default .Values.server.nodeSelector | default dict }}
{{- toJson $sel }}
{{- end }}

{{- define "inferscale.encoderTolerations" -}}
{{- $tol := .Values.encoder.tolerations | default .Values.server.tolerations | default list }}
{{- toJson $tol }}
{{- end }}

{{/* OTEL_* settings as ConfigMap data; call with (dict "ctx" $ "component" "server"). */}}
{{- define "inferscale.otelConfig" -}}
{{- $o := .ctx.Values.otel }}
{{- $attrs := list (printf "k8s.namespace.name=%s" .ctx.Release.Namespace) }}
{{- if $o.resourceAttributes }}{{ $attrs = append $attrs $o.resourceAttributes }}{{ end }}
OTEL_SERVICE_NAME: {{ printf "%s-%s" $o.serviceNamePrefix .component | quote }}
OTEL_RESOURCE_ATTRIBUTES: {{ join "," $attrs | quote }}
{{- if $o.enabled }}
OTEL_SDK_DISABLED: "false"
OTEL_EXPORTER_OTLP_ENDPOINT: {{ required "otel.endpoint is required when otel.enabled is true" $o.endpoint | quote }}
OTEL_EXPORTER_OTLP_PROTOCOL: {{ $o.protocol | quote }}
OTEL_TRACES_EXPORTER: "otlp"
OTEL_METRICS_EXPORTER: {{ $o.metricsExporter | quote }}
OTEL_LOGS_EXPORTER: {{ $o.logsExporter | quote }}
OTEL_TRACES_SAMPLER: {{ $o.tracesSampler | quote }}
OTEL_TRACES_SAMPLER_ARG: {{ $o.tracesSamplerArg | quote }}
{{- else }}
OTEL_SDK_DISABLED: "true"
{{- end }}
{{- end }}

{{/* Optional OTLP headers from a Secret (env entry). */}}
{{- define "inferscale.otelHeadersEnv" -}}
{{- if and .Values.otel.enabled .Values.otel.headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.otel.headersSecret.name }}
      key: {{ .Values.otel.headersSecret.key }}
{{- end }}
{{- end }}

{{- define "inferscale.internalTokenEnv" -}}
- name: INFERSCALE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "inferscale.internalTokenSecretName" . }}
      key: internal-token
{{- end }}

{{/* optional: an existingSecret without the key leaves /metrics unserved. */}}
{{- define "inferscale.metricsTokenEnv" -}}
- name: INFERSCALE_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "inferscale.internalTokenSecretName" . }}
      key: metrics-token
      optional: true
{{- end }}

{{- define "inferscale.peerSecretEnv" -}}
- name: INFERSCALE_PEER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "inferscale.internalTokenSecretName" . }}
      key: peer-secret
{{- end }}

{{/* The UCX data port range "lo-hi" as a list of two ints. */}}
{{- define "inferscale.ucxRange" -}}
{{- $parts := splitList "-" .Values.server.ucxPortRange }}
{{- if or (ne (len $parts) 2) (gt (int (index $parts 0)) (int (index $parts 1))) }}
{{- fail (printf "server.ucxPortRange must be \"lo-hi\" with lo <= hi, not %q" .Values.server.ucxPortRange) }}
{{- end }}
{{- toJson (list (int (index $parts 0)) (int (index $parts 1))) }}
{{- end }}

{{/* "<fullname>-<suffix>", short enough for any object name (a StatefulSet's must leave room for the
controller-revision-hash label: 52). Call with (dict "ctx" $ "suffix" "server"). */}}
{{- define "inferscale.componentName" -}}
{{- $max := sub 51 (len .suffix) | int }}
{{- printf "%s-%s" (include "inferscale.fullname" .ctx | trunc $max | trimSuffix "-") .suffix }}
{{- end }}

{{/* The tenants file: apiKeys.tenantsFile verbatim, else apiKeys.tenants as JSON ("{}" = no tenants). */}}
{{- define "inferscale.tenantsFileContent" -}}
{{- if .Values.apiKeys.tenantsFile }}
{{- .Values.apiKeys.tenantsFile }}
{{- else }}
{{- toPrettyJson (.Values.apiKeys.tenants | default dict) }}
{{- end }}
{{- end }}
