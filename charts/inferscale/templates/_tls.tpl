{{/* TLS of the internal API and the peer control channel (templates/tls.yaml; inferscale/fleettls.py). */}}

{{/* The Secret with ca.crt, tls.crt and tls.key: tls.existingSecret, else <fullname>-tls (made by the chart). */}}
{{- define "inferscale.tlsSecretName" -}}
{{- default (include "inferscale.componentName" (dict "ctx" . "suffix" "tls")) .Values.tls.existingSecret }}
{{- end }}

{{/* The name the fleet certificate holds and every client checks (pods are reached by IP; SNI carries this):
the headless Service's in-cluster name. */}}
{{- define "inferscale.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "inferscale.componentName" (dict "ctx" . "suffix" "headless")) .Release.Namespace) -}}
{{- end }}

{{- define "inferscale.tlsMount" -}}/var/run/inferscale/tls{{- end }}

{{/* INFERSCALE_TLS_* of a ConfigMap; (dict "ctx" $ "server" true) for a serving pod (its certificate and key too). */}}
{{- define "inferscale.tlsEnv" -}}
{{- if .ctx.Values.tls.enabled }}
# TLS on the internal API and the peer control channel (the fleet CA, the certificate's name; servers: their
# certificate and key), files of the mounted Secret {{ include "inferscale.tlsSecretName" .ctx }}.
INFERSCALE_TLS_CA_FILE: {{ printf "%s/ca.crt" (include "inferscale.tlsMount" .ctx) | quote }}
INFERSCALE_TLS_SERVER_NAME: {{ include "inferscale.tlsServerName" .ctx | quote }}
{{- if .server }}
INFERSCALE_TLS_CERT_FILE: {{ printf "%s/tls.crt" (include "inferscale.tlsMount" .ctx) | quote }}
INFERSCALE_TLS_KEY_FILE: {{ printf "%s/tls.key" (include "inferscale.tlsMount" .ctx) | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The volume: (dict "ctx" $ "keys" (list "ca.crt" ...)). Mounted whole (no subPath), so a rotated Secret reaches
the files in place and the next handshake uses it. */}}
{{- define "inferscale.tlsVolume" -}}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "inferscale.tlsSecretName" .ctx }}
    defaultMode: 0440
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- end }}

{{- define "inferscale.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "inferscale.tlsMount" . }}
  readOnly: true
{{- end }}
{{- end }}
