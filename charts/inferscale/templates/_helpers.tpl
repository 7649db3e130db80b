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

{{/* An image reference: "<repository>@<digest>" when a digest is given (pinned, CKV_K8S_43), else "<repository>:<tag>".
Call with (dict "repository" ... "tag" ... "digest" ...). */}}
{{- define "inferscale.imageRef" -}}
{{- if .digest }}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" .digest) }}
{{- fail (printf "image digest must be sha256:<64 hex>, not %q" .digest) }}
{{- end }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository .tag }}
{{- end }}
{{- end }}

{{- define "inferscale.image" -}}
{{- include "inferscale.imageRef" (dict "repository" .Values.image.repository "tag" (include "inferscale.imageTag" .)
    "digest" .Values.image.digest) }}
{{- end }}

{{/* The serving pods' image: the trtllm image when engine=trtllm (TensorRT-LLM inside), else the serving image. */}}
{{- define "inferscale.serverImage" -}}
{{- if eq .Values.engine "trtllm" }}
{{- printf "%s:%s" .Values.trtllm.image.repository (default (include "inferscale.imageTag" .) .Values.trtllm.image.tag) }}
{{- else }}
{{- include "inferscale.image" . }}
{{- end }}
{{- end }}

{{/* The operator's image: the slim `operator` target of the Dockerfile (no torch); empty repository = the serving image. */}}
{{- define "inferscale.operatorImage" -}}
{{- with .Values.operator.image }}
{{- if .repository }}
{{- include "inferscale.imageRef" (dict "repository" .repository "tag" (default (include "inferscale.imageTag" $) .tag)
    "digest" .digest) }}
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

{{/* Optional OTLP headers from a Secret, as a file of the server (INFERSCALE_OTEL_HEADERS_FILE; never an env var).
The operator exports no telemetry, so only the servers mount it. */}}
{{- define "inferscale.otelHeaders" -}}
{{- if and .Values.otel.enabled .Values.otel.headersSecret.name }}true{{ end }}
{{- end }}

{{- define "inferscale.otelHeadersFile" -}}/var/run/inferscale/otel/headers{{- end }}

{{/* Where servers and the operator see the internal Secret's keys as files (INFERSCALE_*_FILE; never env vars). */}}
{{- define "inferscale.internalMount" -}}/var/run/inferscale/internal{{- end }}

{{/* The internal Secret as a volume: call with (dict "ctx" $ "keys" (list "internal-token" ...)). Group-readable
only by the pod's fsGroup (kubelet adds g+r under fsGroup whatever the mode), which inferscale/secretfile.py allows. */}}
{{- define "inferscale.internalVolume" -}}
- name: internal
  secret:
    secretName: {{ include "inferscale.internalTokenSecretName" .ctx }}
    defaultMode: 0440
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}

{{- define "inferscale.internalVolumeMount" -}}
- name: internal
  mountPath: {{ include "inferscale.internalMount" . }}
  readOnly: true
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

{{/* Egress to the cluster DNS (networkPolicy.dns: the peers that serve it), UDP and TCP 53. */}}
{{- define "inferscale.dnsEgress" -}}
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
  to:
    {{- toYaml .Values.networkPolicy.dns | nindent 4 }}
{{- end }}

{{/* The namespace of the encode/cleanup Jobs and the operator's records: encoder.namespace, else
"<release namespace>-jobs". Never the release namespace, which holds the platform's Secrets: a Job there could
mount any of them, and the operator would need rights to create pods there. */}}
{{- define "inferscale.jobNamespace" -}}
{{- $ns := .Values.encoder.namespace | default (printf "%s-jobs" .Release.Namespace) }}
{{- if eq $ns .Release.Namespace }}
{{- fail (printf "encoder.namespace must not be the release namespace %q: it holds the platform's Secrets; the Jobs need a namespace of their own" $ns) }}
{{- end }}
{{- if gt (len $ns) 63 }}
{{- fail (printf "the Jobs' namespace %q is longer than 63 characters: set encoder.namespace" $ns) }}
{{- end }}
{{- $ns }}
{{- end }}

{{/* The operator's rules where its Jobs live: run them, read their pods, keep items ConfigMaps and records. */}}
{{- define "inferscale.jobRules" -}}
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "get", "list", "watch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "get", "list", "watch", "patch", "delete"]
{{- end }}

{{/* A NetworkPolicy peer: the operator's encode Job pods, in the Jobs' namespace. */}}
{{- define "inferscale.encodeJobPeer" -}}
podSelector:
  matchLabels:
    app.kubernetes.io/managed-by: inferscale-operator
    inferscale.io/role: encode
namespaceSelector:
  matchLabels:
    kubernetes.io/metadata.name: {{ include "inferscale.jobNamespace" . }}
{{- end }}
